"""Typed, frozen run configuration. Standard library only (towerlab.fields maps it to dicts and flags).

One dataclass per concern: `TrainConfig` holds what changes the numbers (the searchable
hyperparameters), `RunConfig` holds where and how the run happens (devices, paths, logging).
Every field carries its help text; the CLI flags are generated from the fields, so a flag and
a config key cannot drift apart. The checks they share (finite numbers, paths, seeds, choices, what a
dataset's name means) are `towerlab.checks`.

It is over 350 lines because each config's help texts are its documentation of every flag: split by
config, the flags would no longer be read in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from towerlab.catalog import datasets
from towerlab.catalog.datasets import parse_image_size
from towerlab.checks import (check_choice, check_dataset, check_finite, check_finite_number, check_path,
                             check_paths, check_positive, check_seed, is_image_folder, parse_shape)
from towerlab.errors import UserError
from towerlab.fields import field_default
from towerlab.catalog.models import CATALOG as MODEL_CATALOG

# The model catalog (towerlab.catalog.models, no torch) is read live: a model added to it is a --model choice.
MODELS = MODEL_CATALOG.keys()
OPTIMIZERS = ("adam", "sgd", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "muon")
SCHEDULES = ("constant", "onecycle", "linear", "decay")
STRATEGIES = ("ddp", "ps")
INPUTS = ("resident", "feed", "queue")
STEPS = ("auto", "eager", "graph", "compiled")
PRECISIONS = ("fp32", "bf16")
TTA = ("none", "flip", "flip-translate")
PRUNE_PLACES = ("all", "new")  # whom a pruned rung's places are counted over: every member, or those still to train
DEVICE_KINDS = ("auto", "cpu", "cuda")
DIRECTIONS = ("maximize", "minimize")  # of a search's metric (towerlab.search.goal.Goal)
# A network given from Python (an nn.Module or a factory of one: towerlab.api.train(model=...)): the model
# name a config records for it (towerlab.checks.ARRAYS_DATASET is images given so).
CUSTOM_MODEL = "custom"
MIN_TIMEOUT, MAX_TIMEOUT = 5.0, 7 * 24 * 3600.0  # seconds


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


def _check_folder_options(cfg: TrainConfig | SearchConfig) -> None:
    if cfg.image_size is not None:
        parse_image_size(cfg.image_size)
    if cfg.test_size is not None and not 0.0 <= cfg.test_size < 1.0:
        raise UserError(f"--test-size is the share of the images held out for testing, in [0, 1), got {cfg.test_size}")
    if (cfg.image_size is not None or cfg.test_size is not None) and not is_image_folder(cfg.dataset):
        raise UserError(f"--image-size and --test-size say how an image folder (PATH/) is read; {cfg.dataset} is none")


IMAGE_SIZE_HELP = ("image folder only: the size HxW every image is scaled to cover and cropped to about its centre "
                   "(None: the folder's most common size, where both sides are at most 128, else 64x64)")
TEST_SIZE_HELP = ("image folder without test/ only: the share of train/'s images held out, stratified, as the "
                  "test set (None: 0.2)")


@dataclass(frozen=True)
class TrainConfig:
    """What a training run computes: equal configs give equal numbers."""

    model: str = _opt("lenet5", "network to train", choices=MODELS)
    model_options: dict = field(
        default_factory=dict,
        metadata={
            "help": "model hyperparameter KEY=VALUE, repeatable "
            "(mlp: layers, neurons, activation; cnn: blocks, filters, kernel_size, dense, dropout; "
            "whitenet: width1, width2, width3, depth; --model FILE.py:FUNCTION: FUNCTION's keyword arguments); "
            "VALUE is read as a number or true/false where it is one, else a string (\"3\" in double quotes: a string)",
            "flag": "model-opt",
        },
    )
    dataset: str = _opt("mnist", "dataset: one of the names, the path of your own .npz, or a folder of images "
                        "(PATH/<class>/*.jpg, or PATH/train/ and PATH/test/; see docs/data.md)", choices=datasets.names())
    val_size: int = _opt(5000, "validation images held out from the end of the training set (an image folder "
                         "without val/: at most a fifth of its training images, stratified)")
    image_size: Optional[str] = _opt(None, IMAGE_SIZE_HELP)
    test_size: Optional[float] = _opt(None, TEST_SIZE_HELP)
    synthetic_shape: str = _opt("1x28x28", "synthetic dataset only: image shape CxHxW")
    synthetic_train: int = _opt(6000, "synthetic dataset only: training images (test: a sixth of it)")
    batch_size: int = _opt(512, "examples per replica per step (global batch = this x replicas)")
    epochs: int = _opt(10, "passes over the training set (ignored when --steps is given)")
    steps: Optional[int] = _opt(None, "total optimizer steps; overrides --epochs")
    lr: float = _opt(0.001, "learning rate (peak rate with --schedule onecycle or linear)")
    optimizer: str = _opt("adam", "optimizer; muon: Muon (torch.optim.Muon) on the convolution filters, SGD with "
                          "--lr, --momentum and --nesterov on the other parameters (airbench94_muon's)",
                          choices=OPTIMIZERS)
    momentum: float = _opt(0.9, "sgd, and muon's other parameters: momentum")
    nesterov: bool = _opt(False, "sgd, and muon's other parameters: Nesterov momentum")
    muon_lr: float = _opt(0.02, "muon only: the filters' learning rate (peak rate under a schedule)")
    muon_momentum: float = _opt(0.95, "muon only: the filters' (Nesterov) momentum")
    muon_ns_steps: int = _opt(5, "muon only: Newton-Schulz iterations that orthogonalise each filter's update "
                              "(airbench94_muon: 3)")
    muon_normalize: bool = _opt(False, "muon only: rescale each filter tensor to norm sqrt(output channels) before "
                                "its update, as airbench94_muon does (for filters a BatchNorm follows, whose output "
                                "the scale does not change)")
    schedule: str = _opt("constant", "learning-rate schedule; linear: from 0.2 x lr up to lr over --warmup of "
                         "the steps, then down to 0.07 x lr at the last step (airbench94's); decay: from lr "
                         "straight down to 0 after the last step (airbench94_muon's)", choices=SCHEDULES)
    warmup: Optional[float] = _opt(None, "fraction of the steps the learning rate rises (None: onecycle 0.3, "
                                   "linear 0.23)")
    norm_lr_scale: float = _opt(1.0, "learning-rate multiplier of normalisation layers' parameters; their "
                                "weight decay is divided by it, so they decay as much per step (airbench94: 64)")
    whiten_bias_epochs: int = _opt(0, "whitenet only: train the whitening layer's bias for the first N epochs only, "
                                   "at the normalisation layers' rate (lr x --norm-lr-scale) falling linearly to 0 "
                                   "by then, and no longer compute its gradient after (airbench94_muon: 3); 0: it "
                                   "trains throughout with the other parameters")
    lookahead: int = _opt(0, "every N steps pull the weights (and BatchNorm statistics) back to their slow "
                          "moving average, which the last step returns (Lookahead); 0: off")
    lookahead_decay: float = _opt(0.95, "per-step decay of the --lookahead average: each pull keeps "
                                  "decay ** N x (step / total steps) ** 3 of the slow weights")
    seed: int = _opt(0, "seed of the model init, the shuffle, dropout and augmentation")
    augment: bool = _opt(False, "augmentation on the device; for CIFAR-10: random crop (zero pad 4) and "
                         "horizontal flip, or see --translate")
    translate: int = _opt(0, "with --augment: instead of the crop, shift each image by up to N pixels "
                          "(reflected borders) and flip it every other epoch, drawn per example, so any "
                          "number of replicas sees the same images (airbench94: 2)")
    precision: str = _opt("fp32", "compute precision (bf16 autocast pays on GPUs)", choices=PRECISIONS)
    label_smoothing: float = _opt(0.0, "label smoothing of the cross-entropy loss")
    weight_decay: float = _opt(0.0, "weight decay (adam becomes AdamW when > 0; sgd adds it to the gradient, as muon does "
                                  "on its other parameters: the filters are not decayed)")
    tta: str = _opt("none", "test-time augmentation of every evaluation: average the logits of the image and "
                    "its mirror (flip), and of both shifted by one pixel up-left and down-right "
                    "(flip-translate: weights 1/2, 1/4, 1/4)", choices=TTA)
    patience: Optional[int] = _opt(None, "stop after this many epochs without a lower validation loss")
    target_accuracy: Optional[float] = _opt(
        None, "stop as soon as validation accuracy reaches this fraction (checked each --eval-every)"
    )
    eval_every: int = _opt(0, "evaluate on validation every N steps as well as each epoch (0: epochs only)")

    def __post_init__(self) -> None:
        check_finite(self)
        check_seed(self.seed)
        if self.model != CUSTOM_MODEL:
            check_choice("model", self.model, MODELS)
        object.__setattr__(self, "dataset", check_dataset(self.dataset))
        _check_folder_options(self)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("tta", self.tta, TTA)
        parse_shape(self.synthetic_shape)
        check_positive("synthetic_train", self.synthetic_train)
        check_positive("batch_size", self.batch_size)
        check_positive("epochs", self.epochs)
        check_positive("steps", self.steps, allow_none=True)
        check_positive("lr", self.lr)
        check_positive("patience", self.patience, allow_none=True)
        if self.val_size < 0:
            raise UserError(f"--val-size must be 0 or more, got {self.val_size}")
        if self.eval_every < 0:
            raise UserError(f"--eval-every must be 0 or more, got {self.eval_every}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay must be 0 or more, got {self.weight_decay}")
        self._check_training_tricks()
        if self.target_accuracy is not None and not 0.0 < self.target_accuracy <= 1.0:
            raise UserError(f"--target-accuracy is a fraction in (0, 1], got {self.target_accuracy}")
        if (self.patience or self.target_accuracy) and self.val_size == 0:
            raise UserError("--patience and --target-accuracy need validation data: set --val-size > 0")

    def _check_training_tricks(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and (self.optimizer not in ("sgd", "muon") or self.momentum == 0):
            raise UserError("--nesterov needs --optimizer sgd (or muon) and a --momentum above 0")
        check_positive("muon_lr", self.muon_lr)
        if not 0.0 <= self.muon_momentum < 1.0:
            raise UserError(f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
        if not 1 <= self.muon_ns_steps < 100:  # torch.optim.Muon refuses 100 and more
            raise UserError(f"--muon-ns-steps must be between 1 and 99, got {self.muon_ns_steps}")
        if self.whiten_bias_epochs < 0:
            raise UserError(f"--whiten-bias-epochs must be 0 (off) or a number of epochs, got {self.whiten_bias_epochs}")
        if self.warmup is not None:
            if self.schedule in ("constant", "decay"):
                raise UserError("--warmup needs --schedule onecycle or linear")
            if not 0.0 <= self.warmup < 1.0:
                raise UserError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        check_positive("norm_lr_scale", self.norm_lr_scale)
        if self.lookahead < 0:
            raise UserError(f"--lookahead must be 0 (off) or a number of steps, got {self.lookahead}")
        if not 0.0 <= self.lookahead_decay <= 1.0:
            raise UserError(f"--lookahead-decay must be in [0, 1], got {self.lookahead_decay}")
        if self.translate < 0:
            raise UserError(f"--translate must be 0 or more pixels, got {self.translate}")
        if self.translate and not self.augment:
            raise UserError("--translate chooses how --augment shifts images: add --augment")


@dataclass(frozen=True)
class RunConfig:
    """Where and how a run happens. Those marked `resume="keep"` change the arithmetic (summation
    order, kernels), so a resumed run keeps them to end exactly where the uninterrupted one would;
    the `"free"` ones never change a number."""

    preset: Optional[str] = _opt(None, "a measured recipe (mnist-fast, cifar-fast, cifar-94) whose settings apply "
                                 "under the flags you type; see docs/training.md")
    device: str = _opt("auto", "where the replicas run: cuda (GPUs over NCCL), cpu (processes over gloo), or "
                       "auto (cuda when a GPU is present)", choices=DEVICE_KINDS, resume="keep")
    devices: Optional[int] = _opt(None, "local replicas (None: every GPU; without one, 2 CPU processes to train, "
                                  "one per core to search; 1 on a one-core machine)", resume="keep")
    strategy: str = _opt("ddp", "how gradients meet: ddp all-reduce, or ps (CPU parameter server)",
                         choices=STRATEGIES, resume="keep")
    input: str = _opt("resident", "resident: data lives on the device; feed: host slices each batch; "
                      "queue: a background thread prefetches pinned batches", choices=INPUTS, resume="free")
    data_dir: Optional[str] = _opt(None, "dataset folder (None: $TOWERLAB_DATA, else the user cache; see "
                                   "docs/data.md)", resume="free")
    download: bool = _opt(True, "download a missing dataset (with checksums)", resume="free")
    allow_changed_data: bool = _opt(False, "--resume only: continue even though the dataset's files changed "
                                    "since the run started (a warning, and both SHA-256s are recorded)",
                                    resume="free")
    out: Optional[str] = _opt(None, "output folder (None: runs/<timestamp>-<model>-<dataset>)")
    resume: Optional[str] = _opt(None, "continue the interrupted run in this folder")
    display_step: int = _opt(100, "print the minibatch loss and accuracy every N steps", resume="free")
    threads: Optional[int] = _opt(None, "CPU threads per process (None: cores / local processes; 1 for a search's "
                                  "CPU workers, so that a result never depends on how many workers ran it)",
                                  resume="keep")
    step: str = _opt("auto", "how each step runs: eager (torch.optim, op by op), graph (one CUDA graph per step), "
                     "compiled (torch.compile of the whole step), auto (graph on one GPU, else eager)",
                     choices=STEPS, resume="keep")
    tensorboard: bool = _opt(False, "write TensorBoard scalars to <out>/tb (needs the tensorboard extra)",
                             resume="free")
    timeout: float = _opt(120.0, "seconds a collective may wait for a peer, and a process may go without a "
                          "heartbeat, before the job fails", resume="free")
    progress: bool = _opt(True, "progress bar when the terminal is interactive (elsewhere, and with --no-progress, "
                          "a training prints a progress line after 30 s without a line)", resume="free")

    def __post_init__(self) -> None:
        check_finite(self)
        check_paths(self, "out", "resume", "data_dir")
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("input", self.input, INPUTS)
        check_choice("step", self.step, STEPS)
        check_choice("device", self.device, DEVICE_KINDS)
        if self.preset is not None:
            from towerlab.presets import get

            get(self.preset)
        if self.devices is not None and self.devices < 1:
            raise UserError(f"--devices must be at least 1, got {self.devices}")
        check_positive("display_step", self.display_step)
        check_positive("threads", self.threads, allow_none=True)
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:
            raise UserError(f"--timeout must be between {MIN_TIMEOUT:g} seconds (replicas wait for each other at "
                            f"every evaluation and checkpoint) and {MAX_TIMEOUT:g} (a week), got {self.timeout}")


# A generation is held in memory and recorded as one row of the search store; a grid is one generation.
MAX_MEMBERS = 1_000_000
MAX_REMEASURE = 100


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A field of a sampler's own settings (`SamplerSettings`): its default, and the help text of
    the flag generated from it."""
    return _opt(default, help, **meta)


@dataclass(frozen=True)
class SamplerSettings:
    """A sampler's own settings (towerlab.search.samplers): a frozen dataclass of `setting` fields,
    which become flags and config keys as SearchConfig's fields do, and are recorded among them.
    A subclass checks its invariants in `check` (a UserError naming the flag)."""

    def __post_init__(self) -> None:
        check_finite(self)
        self.check()

    def check(self) -> None:
        """Nothing to check beyond finite numbers."""


@dataclass(frozen=True, init=False)
class SearchConfig:
    """A network search: the sampler that proposes candidates, its budget, and how candidates train.

    Built flat, as flags and config keys are: `SearchConfig(sampler="ga", elite=2)`. Keys that are
    none of its fields are the sampler's own settings (its `SamplerSettings`), kept in `settings`
    and checked by the sampler (towerlab.search.samplers); `to_dict` writes them among the fields."""

    sampler: str = _opt("auto", "how candidates are proposed: auto (gp where a numeric range is in every "
                        "trial, unpruned; else tpe), ga (the original's GA), gp (Optuna's Gaussian process), grid, random (without "
                        "replacement) or tpe (Optuna's TPE); auto, gp and tpe need the tpe extra")
    space: str = _opt("mlp", "search space: mlp, cnn, whitenet, a TOML file giving each gene's values "
                     "(a list, or a range {low, high, log, step}), or the same as JSON text")
    objective: Optional[str] = _opt(None, "FILE.py:FUNCTION: search your own training, a function given the genes "
                                    "as keywords that returns a number or a dict of them (docs/objectives.md)")
    trial_command: Optional[str] = _opt(None, "search your own training as a command run per trial ('python train.py "
                                        "--lr {lr}'; its last JSON line is its result)", flag="command")
    metric: Optional[str] = _opt(None, "the objective's metric searched, its name in the result (None: value)")
    direction: Optional[str] = _opt(None, "maximize or minimize --metric (None: maximize)", choices=DIRECTIONS)
    trial_timeout: Optional[float] = _opt(None, "seconds a trial may run (a training of towerlab's networks, or of your "
                                                "objective), then it is stopped and fails")
    dataset: str = _opt("mnist", "dataset the candidates train on: one of the names, the path of your own "
                        ".npz, or a folder of images (PATH/)", choices=datasets.names())
    val_size: int = _opt(5000, "validation images (the fitness is validation accuracy)")
    image_size: Optional[str] = _opt(None, IMAGE_SIZE_HELP)
    test_size: Optional[float] = _opt(None, TEST_SIZE_HELP)
    population: Optional[int] = _opt(None, "candidates per generation (None: the sampler's own: ga and random 20; "
                                     "tpe 4, gp 1 (2 pruned), proposed before their outcomes are told; auto, its choice's)")
    generations: Optional[int] = _opt(None, "generations (rounds of --population candidates) at most "
                                      "(None: the sampler's own: 10, gp's 20; auto, its choice's)")
    max_evaluations: Optional[int] = _opt(None, "stop after training this many distinct networks, whatever the "
                                          "sampler (None: no limit; re-measures and higher rungs not counted)")
    budget_epochs: Optional[int] = _opt(None, "stop once the trainings were given this many epochs in all (every "
                                        "rung and re-measure counted; None: no limit)")
    seed: int = _opt(0, "seed of the search; candidate seeds derive from (seed, generation, index)")
    remeasure: Optional[int] = _opt(None, "fresh seeds a network about to be crowned (ga's elite, the final top) is "
                                    "trained with again; such networks rank by their mean (0: every network is "
                                    "measured once; None: 2, fewer where they would cost more than a quarter of "
                                    "the search's trainings)")
    max_epochs: int = _opt(10, "epochs a candidate may train at most (a space with an `epochs` gene, like "
                               "whitenet, sets each candidate's own)")
    patience: int = _opt(5, "a candidate stops after this many epochs without a lower validation loss")
    min_epochs: Optional[int] = _opt(None, "prune: train every candidate this many epochs first, then promote "
                                     "the best 1/--prune-factor rung by rung up to --max-epochs (None: no pruning)")
    prune_factor: int = _opt(3, "prune: each rung keeps the best 1/N of the rung below and trains about N times longer")
    prune_places: str = _opt("all", "prune: whom a rung's places (1/--prune-factor of them) are counted over and "
                             "given to: all (every member at the rung, the kept ones that already hold the next "
                             "rung included) or new (only the members that do not hold the next rung yet; "
                             "those that do go on besides)", choices=PRUNE_PLACES)
    batch_size: Optional[int] = _opt(None, "batch size of candidates (None: 128, or 64 on CIFAR-10; "
                                     "a batch_size gene overrides it)")
    top: int = _opt(5, "networks listed (and tested) at the end")
    export_best: bool = _opt(False, "retrain the winner exactly as it was evaluated and save it as model.pt")
    workers_per_device: int = _opt(1, "candidates trained at once on each device (small nets cannot fill a GPU)")
    store: Optional[str] = _opt(None, "the search store, which caches every evaluation and queues the work: an "
                                "SQLite file, or a PostgreSQL database that workers on other machines join, "
                                "postgresql://USER@HOST/DB (the password from $PGPASSWORD or ~/.pgpass) "
                                "(None: $TOWERLAB_STORE, else <out>/search.db)")
    settings: dict = field(default_factory=dict, metadata={"help": "the sampler's own settings", "flat": True})

    def __init__(self, **values: Any) -> None:
        """Flat keywords, as a flag or a config key names them; unknown ones are settings of some
        sampler, which refuses those it does not know (config.py cannot: samplers live above it)."""
        fields = dataclasses.fields(self)
        names = {f.name for f in fields}
        for f in fields:
            default = field_default(f)
            object.__setattr__(self, f.name, values.get(f.name, default))
        object.__setattr__(self, "settings", {**self.settings, **{k: v for k, v in values.items() if k not in names}})
        self.__post_init__()

    def __post_init__(self) -> None:
        check_finite(self)
        for name, value in self.settings.items():  # their samplers check the rest; nan passes every check unnoticed
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                check_finite_number(name.replace("_", "-"), value)
        check_seed(self.seed)
        check_paths(self, "store")
        if not self.space.lstrip().startswith("{"):  # a space given as JSON text is no path
            check_path("--space", self.space)
        object.__setattr__(self, "dataset", check_dataset(self.dataset))
        _check_folder_options(self)
        check_members("population", self.population)
        if self.population is not None and self.population < 1:
            raise UserError(f"--population must be at least 1, got {self.population}")
        for name in ("max_epochs", "patience", "top", "workers_per_device"):
            check_positive(name, getattr(self, name))
        for name in ("generations", "batch_size", "max_evaluations", "min_epochs", "budget_epochs", "trial_timeout"):
            check_positive(name, getattr(self, name), allow_none=True)
        if self.val_size <= 0:
            raise UserError("--val-size must be positive: the fitness is validation accuracy")
        if self.remeasure is not None and not 0 <= self.remeasure <= MAX_REMEASURE:
            raise UserError(f"--remeasure must be between 0 and {MAX_REMEASURE}, got {self.remeasure}")
        if self.min_epochs is not None and self.min_epochs >= self.max_epochs:
            raise UserError(f"--min-epochs ({self.min_epochs}) must be below --max-epochs ({self.max_epochs}): "
                            "the first rung trains less than the last")
        if self.prune_factor < 2:
            raise UserError(f"--prune-factor must be at least 2, got {self.prune_factor}")
        check_choice("--prune-places", self.prune_places, PRUNE_PLACES)
        if self.direction is not None:  # the rest of what names an objective is its kind's (towerlab.objective)
            check_choice("--direction", self.direction, DIRECTIONS)
        if self.min_epochs is None and self.prune_places != "all":
            raise UserError(f"--prune-places {self.prune_places} does nothing without --min-epochs: "
                            "the search is not pruned (add --min-epochs, or drop --prune-places)")


def check_members(name: str, value: Optional[int]) -> None:
    if value is not None and value > MAX_MEMBERS:
        raise UserError(f"--{name} {value} is more than a generation can hold: at most {MAX_MEMBERS} "
                        "(a generation is kept in memory and recorded as one row of the store)")
