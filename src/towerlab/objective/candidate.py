"""The bridge between the search and training: genome -> TrainConfig -> validation accuracy.

A genome holds model genes (the options of the space's model family) and training genes
(optimizer, lr, batch_size, epochs, label_smoothing). What a genome leaves open comes from the
search's settings: each optimizer trains at its own default learning rate (as in the original), the
batch size is 128 (64 on CIFAR-10), at most `max_epochs` epochs with early stopping after `patience`
epochs without a lower validation loss; the weights of the best epoch are the candidate's. A family
with a training recipe (`RECIPES`: whitenet trains as the cifar-94 preset on one device) takes the
rest from it: its optimizer settings, learning rate, batch size, schedule, augmentation.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import shlex
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from towerlab.config import CUSTOM_MODEL, SearchConfig, TrainConfig
from towerlab.errors import UserError
from towerlab.fields import to_dict, to_flags
from towerlab.data.load import Dataset
from towerlab.distributed.env import device_name
from towerlab.distributed.group import Context
from towerlab.distributed.signals import Interrupted, StopFlag
from towerlab.catalog.models import entry
from towerlab.models.custom import ModelFunction, function_file
from towerlab.presets import apply_preset
from towerlab.search import Outcome, genome_hash
from towerlab.search.candidates import raised
from towerlab.training.optim import DEFAULT_LR
from towerlab.training.divergence import Diverged
from towerlab.training import checkpoint
from towerlab.training.loop import LoopOptions, TrainResult, train
from towerlab.training.network import check_setup

TRAINING_GENES = ("optimizer", "lr", "batch_size", "epochs", "label_smoothing")
# What a search's networks are built from: a family's name, or a model function of yours,
# `function(input_shape, num_classes, **model_genes) -> nn.Module`, which gets every gene that is not a
# training gene.
CandidateModel = Union[str, ModelFunction]
DEFAULT_BATCH = {"cifar10": 64}  # the original's; 128 for the MNIST-like sets
# Bumped whenever candidate training changes what it computes, so a store's cache never serves
# fitnesses that today's code would not reproduce. A recipe's own settings are in its family's training
# settings (`training_settings`): a changed recipe changes that family's cache alone.
FITNESS_VERSION = 2
CHECKPOINT = "checkpoint.pt"  # what a lower rung leaves in its trial folder for its promotion
RECIPES = {"whitenet": "cifar-94"}  # model family -> the preset its candidates train with
# What a recipe does not decide for a candidate: the search's own settings and the genome do.
_NOT_FROM_RECIPE = ("model", "dataset", "val_size", "epochs", "steps", "seed", "patience", "target_accuracy")
_OPTIMIZER_SETTINGS = ("lr", "momentum", "nesterov", "muon_lr", "muon_momentum", "muon_ns_steps", "muon_normalize")


def recipe(model: str, optimizer: str | None = None) -> dict:
    """The TrainConfig fields a candidate of family `model` takes from its preset (one device's
    variant), without those of the preset's optimizer when the genome picks another one."""
    if model not in RECIPES:
        return {}
    settings = {k: v for k, v in apply_preset(RECIPES[model], "cuda").items() if k not in _NOT_FROM_RECIPE}
    if optimizer is not None and optimizer != settings.get("optimizer"):
        settings = {k: v for k, v in settings.items() if k not in _OPTIMIZER_SETTINGS}
    return settings


def training_settings(cfg: SearchConfig, device_type: str, threads: Optional[int],
                      model: Optional[CandidateModel] = None, data_digest: Optional[str] = None,
                      model_proof: Optional[str] = None) -> dict:
    """Everything besides the genome and the seed that decides a candidate's fitness: the search's
    settings, and the numerics of its workers that the search chooses (the device kind, and on a CPU
    the threads per candidate, whose count changes a float sum's order and so the result). The data's
    content is its `data_digest` (`towerlab.data.digest`: of the arrays trained on, whatever the dataset
    is), where given: a search records it (since schema 5), so that its cache never serves rows trained on
    other data under the same name (the offline fallback's digits are "mnist" too, an edited .npz or image
    folder keeps its path); one recorded before is identified by its settings alone. A model function's
    file and the modules of yours it imports are its `model_proof` (`towerlab.proof.Proof.digest`), where
    given (a search records it since issue 65: a neighbour `blocks.py` edited is other networks)."""
    settings = {"dataset": cfg.dataset, "val_size": cfg.val_size, "max_epochs": cfg.max_epochs,
                "patience": cfg.patience, "batch_size": cfg.batch_size, "fitness_version": FITNESS_VERSION,
                "numerics": {"device": device_type, **({"threads": threads} if device_type == "cpu" else {})}}
    if data_digest is not None:
        settings["dataset_content"] = data_digest
    if callable(model):
        settings["model_function"] = function_identity(model)
        if model_proof is not None:
            settings["model_proof"] = model_proof
    elif model in RECIPES:
        settings["recipe"] = recipe(model)
    return settings


def numerics(train_cfg: TrainConfig, device: torch.device) -> dict:
    """What a training's result depends on besides its settings and seed, as this process runs it:
    recorded with every evaluation, so a store shared by machines, or a search resumed on another,
    says which results came from where."""
    return {"device": device_name(device), "threads": torch.get_num_threads(), "precision": train_cfg.precision,
            "torch": torch.__version__}


def function_identity(function: Callable) -> str:
    """A model function's name and the hash of its source: another function, or the same one edited,
    is another cache (an edit to what it calls is not seen: the source is all there is to read)."""
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', type(function).__name__)}"
    try:
        text = inspect.getsource(function)
    except (OSError, TypeError):  # defined where no source is kept (stdin, a console): the name alone
        return name
    return f"{name}:{hashlib.sha256(text.encode()).hexdigest()}"


def train_config_hash(cfg: SearchConfig, device_type: str, threads: Optional[int],
                      model: Optional[CandidateModel] = None, data_digest: Optional[str] = None,
                      model_proof: Optional[str] = None) -> str:
    """`device_type`, `threads`: the workers' device kind and CPU threads per candidate; `model`: a model
    function of yours (see `Model`); `data_digest`, `model_proof`: see `training_settings`."""
    return genome_hash(training_settings(cfg, device_type, threads, model, data_digest, model_proof))


def model_function(model: CandidateModel) -> Callable[..., torch.nn.Module]:
    """A candidate's model function, `function(input_shape, num_classes, **model_genes) -> nn.Module`:
    a family's is its catalog entry's builder (its network class), a function of yours is itself."""
    return entry(model).builder if isinstance(model, str) else model


def candidate_config(cfg: SearchConfig, model: CandidateModel, genome: dict, seed: int,
                     max_epochs: int | None = None) -> TrainConfig:
    """The training of one candidate; `max_epochs` below the search's caps it (a pruned search's
    lower rung), an epochs gene included. A candidate records its model genes as the model's options
    (what rebuilds it: `load_model` for a family, the function for one of yours, which records
    "custom" as its model)."""
    name = model if isinstance(model, str) else CUSTOM_MODEL
    base = recipe(name, genome.get("optimizer"))
    optimizer = genome.get("optimizer", base.get("optimizer", "adam"))
    training = {**base, **{k: v for k, v in genome.items() if k in TRAINING_GENES}}
    epochs = genome.get("epochs", cfg.max_epochs)
    if max_epochs is not None and max_epochs < cfg.max_epochs:
        epochs = min(epochs, max_epochs)
    return TrainConfig(**{
        **training,
        "model": name,
        "model_options": model_genes(genome),
        "dataset": cfg.dataset, "val_size": cfg.val_size, "image_size": cfg.image_size, "test_size": cfg.test_size,
        "batch_size": genome.get("batch_size", cfg.batch_size or base.get("batch_size")
                                 or DEFAULT_BATCH.get(cfg.dataset, 128)),
        "epochs": epochs,
        "lr": training.get("lr", DEFAULT_LR[optimizer]), "optimizer": optimizer,
        "seed": seed, "patience": cfg.patience,
    })


def model_genes(genome: dict) -> dict:
    """The genes that are not the training's: the keywords of the model function (a family's options)."""
    return {k: v for k, v in genome.items() if k not in TRAINING_GENES}


def estimated_cost(cfg: SearchConfig, model: CandidateModel, genome: dict, input_shape: tuple[int, int, int],
                   num_classes: int, max_epochs: int | None = None) -> float:
    """Forward FLOPs per example times epochs, counted on the meta device (nothing is allocated).
    Only used to hand the most expensive candidates out first, so that a generation does not end
    waiting for one big network that started last. 0 for a genome that cannot be built."""
    train_cfg = candidate_config(cfg, model, genome, 0, max_epochs)
    try:
        with torch.device("meta"), _FlopCount() as counter:
            network(model, genome, input_shape, num_classes)(torch.zeros(1, *input_shape))
    except (Exception, SystemExit):  # noqa: BLE001 - the candidate will fail in training and be recorded so
        return 0.0
    return float(counter.total) * train_cfg.epochs


class _FlopCount(TorchDispatchMode):
    """The FLOPs of what runs under it in this thread, by torch's formulas (`flop_registry`), an operator
    without one counted by what it decomposes into. Not torch's FlopCounterMode: that one also enters a
    ModuleTracker, whose hooks are global, so that every thread's modules ran them; a search worker
    counting a candidate in its leader thread while its main thread trained died of it (a segfault)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        if func._overloadpacket not in flop_registry and func is not torch.ops.prim.device.default:
            with self:
                parts = func.decompose(*args, **kwargs)
            if parts is not NotImplemented:
                return parts
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def network(model: CandidateModel, genome: dict, input_shape: tuple[int, int, int], num_classes: int) -> torch.nn.Module:
    """A candidate's network: what its model function returns for its genes."""
    return model_function(model)(input_shape, num_classes, **model_genes(genome))


class Rung(NamedTuple):
    """What a candidate trains: its `epochs` (a pruned search's rung's; None: the search's --max-epochs) and, in
    a pruned search, the `folder` it keeps its checkpoint in from rung to rung (its trial folder: the genome's
    and seed's) and the epochs it `starts` from (`towerlab.search.candidates.Candidate.starts`)."""

    epochs: Optional[int] = None
    folder: Optional[Path] = None
    starts: int = 0


def train_candidate(cfg: SearchConfig, model: CandidateModel, genome: dict, seed: int, data: Dataset,
                    device: torch.device, *, test_from: Optional[float] = None, stop: StopFlag | None = None,
                    rung: Rung = Rung()) -> tuple[Outcome, Optional[TrainResult]]:
    """Train one genome on this process's device. Returns its Outcome and the TrainResult; a candidate that
    diverges, runs out of memory or whose code raises is a failed Outcome with its reason (`failure`), not a
    crash. Its test accuracy is in the Outcome where its validation accuracy reaches `test_from` (-inf:
    whatever it reaches; a worker's bar for a network that may enter its search's top; None: never).

    It trains for its `rung`'s epochs. Given the rung's folder (a pruned search's trial folder), a training
    whose course does not depend on its length (`continuable`) continues: one below the search's --max-epochs
    leaves its checkpoint in the folder, and a promotion (`starts` > 0) goes on from the checkpoint it finds,
    else from scratch, to the same result; its Outcome says it `continued` `starts` epochs either way (what
    --budget-epochs charges: the same whoever trained it)."""
    started = time.perf_counter()
    numbers: Optional[dict] = None
    continued = 0
    try:
        # A genome's values are checked here, as its network is: one that no training takes fails alone.
        max_epochs = rung.epochs
        train_cfg = candidate_config(cfg, model, genome, seed, max_epochs)
        numbers = numerics(train_cfg, device)
        # the function itself with its arguments (not a lambda), so that its failure names it
        source = functools.partial(model, data.input_shape, data.num_classes, **model_genes(genome)) \
            if callable(model) else None
        check_setup(train_cfg, 1, data, source)
        kept = rung.folder / CHECKPOINT if rung.folder is not None and continuable(train_cfg) else None
        continued = rung.starts if kept is not None else 0
        last = max_epochs is None or max_epochs >= cfg.max_epochs  # the last rung: nothing will continue it
        leaves = None if last else kept  # the checkpoint it leaves its promotion
        if leaves is not None:
            leaves.parent.mkdir(parents=True, exist_ok=True)
        result = train(train_cfg, Context(device=device), data,
                       LoopOptions(test=False, test_from=test_from, stop=stop, setup_apart=False,
                                   checkpoint_path=leaves),
                       source=source, resume_state=_left(kept, train_cfg) if kept is not None and continued else None)
        if kept is not None and last:
            for path in checkpoint.candidates(kept):
                path.unlink(missing_ok=True)
    except Interrupted:
        raise
    except torch.cuda.OutOfMemoryError:
        _free(device)
        return Outcome.failed("out of memory", seconds=time.perf_counter() - started, numerics=numbers), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a candidate's failure is data: the search goes on
        return Outcome.failed(failure(exc), seconds=time.perf_counter() - started, numerics=numbers), None
    return Outcome("ok", fitness=result.val_accuracy, val_loss=result.val_loss, epochs=math.ceil(result.epochs),
                   seconds=time.perf_counter() - started, numerics=numbers, test_accuracy=result.test_accuracy,
                   curve=curve_of(result.history), continued=continued), result


def continuable(cfg: TrainConfig) -> bool:
    """Whether a training's first epochs are those of any longer training of the same settings: none of its
    course depends on its length (a constant learning rate, no --lookahead averaging, a budget in epochs)."""
    return cfg.schedule == "constant" and not cfg.lookahead and cfg.steps is None


def _left(path: Path, cfg: TrainConfig) -> Optional[dict]:
    """The checkpoint a lower rung left at `path`, where it is one of `cfg`'s training but for its length
    (None: none there, unreadable, or another training's: the promotion starts from scratch)."""
    try:
        state = checkpoint.load(path, log=lambda line: None)
    except UserError:
        return None
    mine, theirs = to_dict(cfg), state.get("config")
    if not isinstance(theirs, dict) or {**theirs, "epochs": mine["epochs"]} != mine or theirs["epochs"] > cfg.epochs:
        return None
    return state


def curve_of(history: list[dict]) -> Optional[list[dict]]:
    """A training's learning curve as an objective of yours reports one: {"epoch": N, "val_accuracy": ...,
    "val_loss": ...} after each epoch N, from 1 (its last evaluation in that epoch); None where it has none.
    The pruner's judge reads it (`towerlab.search.judge`)."""
    points: dict[int, dict] = {}
    for record in history:
        if record.get("val_accuracy") is not None:
            loss = record.get("val_loss")
            points[int(record["epoch"])] = {"epoch": int(record["epoch"]), "val_accuracy": float(record["val_accuracy"]),
                                            "val_loss": float(loss) if loss is not None and math.isfinite(loss) else None}
    return [points[epoch] for epoch in sorted(points)] or None


def failure(exc: BaseException) -> str:
    """A candidate's failure reason where its training raised `exc`: a divergence says itself, sys.exit() in a
    model function or its forward says that code called it, any other exception its type and its message's
    first line (`towerlab.search.candidates.raised`)."""
    if isinstance(exc, Diverged):
        return str(exc)
    if isinstance(exc, SystemExit):  # that code failed, not the search
        return f"SystemExit: code the candidate ran called sys.exit({'' if exc.code is None else repr(exc.code)})"
    return raised(exc)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def retrain_command(cfg: SearchConfig, model: CandidateModel, genome: dict, seed: int, max_epochs: int | None = None,
                    cpu_threads: int | None = None) -> str:
    """The `towerlab train` command that trains this candidate again as it was evaluated: on one device,
    and where the search ran on CPUs (`cpu_threads`), on the CPU with as many threads (another count
    sums in another order: other numbers). A model function of yours is named by its file, --model
    FILE.py:FUNCTION, and gets its genes as --model-opt; where no file defines it (given from Python),
    the text says so plainly, beside the command that would retrain it."""
    flags = to_flags(candidate_config(cfg, model, genome, seed, max_epochs)) + ["--devices", "1"]
    if cpu_threads is not None:
        flags += ["--device", "cpu", "--threads", str(cpu_threads)]
    if not callable(model):
        return shlex.join(["towerlab", "train", *flags])  # quoted for a shell: a gene may read act=$(id)
    name = getattr(model, "__name__", "FUNCTION")
    spec = function_file(model)
    flags[flags.index("--model") + 1] = spec or f"FILE.py:{name}"
    command = shlex.join(["towerlab", "train", *flags])
    if spec is None:
        return f"none: {name} was given from Python, not from a file; where FILE.py defines it: {command}"
    return command
