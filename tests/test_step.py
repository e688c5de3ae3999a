"""The step program (issue 38), proven on the CPU: what a GPU run will rely on.

- Its update is torch.optim's arithmetic: in float64, every optimizer under every schedule equals
  torch.optim to 1e-12 (so the gaps in float32 are rounding, which Adam's division by the gradient's
  own size amplifies where gradients are tiny: an honest comparison of whole runs uses SGD, or one
  step).
- The whole step compiles as one graph (`fullgraph=True`, the aot_eager backend: the graph inductor
  would take, without its minute of compiling) and is never compiled again, across epochs, a
  Lookahead pull, evaluations and a changing schedule.
- A steady step reads nothing back: no `.item()`, no `bool()` of a tensor, no `nonzero`, no tensor
  made from host data, no copy to the host.
- It equals the eager step, on one rank and over two (its own all-reduce), and keeps every state
  tensor at its address through steps, epochs, the warm-up's undo and a resume.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: F401 - the dispatch test names ops of its namespace
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import towerlab.training.program
from towerlab.models.preprocessing import Normalizer
from towerlab.training.batches import Batches
from towerlab.cli import build_parser, main
from towerlab.commands import resolve_train
from towerlab.config import RunConfig, TrainConfig
from towerlab.distributed.group import Context, session
from towerlab.distributed.launch import launch
from towerlab.errors import UserError
from towerlab.training.optim import DEFAULT_LR, Group, ScheduledOptimizer
from towerlab.training.update import Update, schedule_tables, uses_momentum
from towerlab.jobs.train import train_data
from towerlab.training.program import StepProgram
from towerlab.training.loop import LoopOptions, train
from towerlab.training.network import build
from util import ONE_CPU, RESUMABLE, TINY, interrupt, max_difference, summary, weights

SCHEDULES = {"adam": ("constant", "onecycle", "linear", "decay"), "sgd": ("constant", "onecycle", "linear", "decay"),
             "nadam": ("constant", "onecycle"), "adamax": ("constant", "onecycle"),
             "rmsprop": ("constant", "onecycle", "linear"), "adagrad": ("constant", "onecycle", "linear"),
             "adadelta": ("constant", "onecycle", "linear"), "muon": ("constant", "onecycle", "decay")}


@pytest.fixture
def aot_eager(monkeypatch):
    """--step compiled through aot_eager: the whole graph, traced as inductor would take it."""
    monkeypatch.setitem(towerlab.training.program.COMPILE_OPTIONS, "cpu", {"backend": "aot_eager"})


@pytest.mark.parametrize("optimizer,schedule", [(o, s) for o, ss in SCHEDULES.items() for s in ss])
def test_the_update_is_torch_optims_arithmetic(optimizer, schedule):
    extra = {"sgd": {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}, "adam": {"weight_decay": 1e-2},
             "rmsprop": {"weight_decay": 1e-3},
             "muon": {"momentum": 0.85, "nesterov": True, "weight_decay": 1e-3, "muon_lr": 0.05,
                      "muon_momentum": 0.6, "muon_ns_steps": 3, "muon_normalize": True}}.get(optimizer, {})
    steps = 25
    cfg = TrainConfig(optimizer=optimizer, lr=0.01, schedule=schedule, steps=steps, norm_lr_scale=4.0, **extra)
    g = torch.Generator().manual_seed(0)
    # Besides the plain and the normalisation groups (the second at 4x the learning rate, as
    # BatchNorm's under airbench94): a whitening bias trained for its first 10 steps, and for muon a
    # wide and a tall filter, one laid out channels last (Muon orthogonalises the matrix of its memory).
    shapes = [(5, 3), (7,), (2, 2, 3), (6,), (4, 3, 3, 3), (8, 1, 1, 2)]
    start = [torch.randn(s, dtype=torch.float64, generator=g) for s in shapes]
    start[4] = start[4].contiguous(memory_format=torch.channels_last)
    groups = [Group([0, 2]), Group([1], 4.0), Group([3], 4.0, "whiten_bias", until=10)]
    if optimizer == "muon":
        groups.append(Group([4, 5], part="muon"))
    else:
        groups[0] = Group([0, 2, 4, 5])
    theirs = [p.clone().requires_grad_() for p in start]
    optimizer_ = ScheduledOptimizer(cfg, theirs, groups, torch.device("cpu"), steps)
    lrs, momenta = schedule_tables(cfg, groups, steps)
    ours = [p.clone() for p in start]
    update = Update(cfg, ours, groups, uses_momentum(optimizer, momenta))
    for s in range(steps):
        # Gradients from 1e-6 to 1: the small ones are where the Adam family divides by little.
        grads = [torch.randn(sh, dtype=torch.float64, generator=g) * 10.0 ** -torch.randint(0, 7, (), generator=g)
                 for sh in shapes]
        grads[4] = grads[4].contiguous(memory_format=torch.channels_last)  # as autograd lays it out
        for p, grad in zip(theirs, grads):
            p.grad = grad.clone()
        optimizer_.step()
        momentum = None if momenta is None else torch.tensor(momenta[s], dtype=torch.float64)
        update([grad.clone() for grad in grads], torch.tensor(lrs[s], dtype=torch.float64), momentum)
    assert max((a.detach() - b).abs().max().item() for a, b in zip(theirs, ours)) < 1e-12
    assert max((a.detach() - b).abs().max().item() for a, b in zip(theirs, start)) > 1e-4  # it moved
    assert not any(torch.equal(a.detach(), b) for a, b in zip(theirs, start))  # each parameter did
    assert [lr[2] for lr in lrs[9:11]] == [pytest.approx(0.04 / 10), 0.0]  # the whitening bias's rate ends


# Models, optimizers and augmentations of the presets and the search spaces, small. Each crosses an
# epoch boundary (1,000 training images at batch 64: 15 steps an epoch).
SHAPE3 = {"synthetic_shape": "3x16x16"}
WHITENET = {"model": "whitenet", "model_options": {"width1": 8, "width2": 16, "width3": 16, "depth": 1}, **SHAPE3,
            "optimizer": "sgd", "lr": 0.2, "momentum": 0.85, "nesterov": True, "weight_decay": 1e-3,
            "norm_lr_scale": 64.0, "schedule": "linear", "lookahead": 3, "augment": True, "translate": 2,
            "label_smoothing": 0.2}
# airbench94_muon's parts (the cifar-94 preset's): Muon on the filters, the whitening bias frozen after
# its first epoch (a second program), its rate kept small so that bf16's rounding inside Muon cannot
# send runs that differ in their last bits apart (tests/test_muon.py holds Muon itself to torch's).
WHITENET_MUON = {**WHITENET, "optimizer": "muon", "schedule": "decay", "lookahead": 0, "muon_lr": 1e-3,
                 "muon_momentum": 0.6, "muon_ns_steps": 3, "muon_normalize": True, "whiten_bias_epochs": 1}
CASES = {
    "mnist-fast": {"model": "lenet5", "optimizer": "adam", "lr": 0.012, "schedule": "onecycle", "precision": "bf16",
                   "label_smoothing": 0.1},
    "cifar-94": WHITENET,
    "cifar-94-muon": WHITENET_MUON,
    "cifar-fast": {"model": "cifarnet", **SHAPE3, "optimizer": "adam", "lr": 0.004, "schedule": "onecycle",
                   "augment": True, "label_smoothing": 0.1, "precision": "bf16"},
    "mlp-space": {"model": "mlp", "model_options": {"layers": 2, "neurons": 32}, "optimizer": "nadam", "lr": 0.002,
                  "augment": True, "schedule": "onecycle"},
    "cnn-space": {"model": "cnn", **SHAPE3, "model_options": {"blocks": 2, "filters": 8, "dense": 32},
                  "optimizer": "rmsprop", "lr": 0.001},
}


def config(case: dict, steps: int = 20, **over) -> TrainConfig:
    return TrainConfig(**{"dataset": "synthetic", "synthetic_train": 1200, "val_size": 200, "batch_size": 64,
                          "steps": steps, **case, **over})


def data_for(cfg: TrainConfig):
    return train_data(cfg, RunConfig(), download=False, log=lambda _: None)


def run(cfg: TrainConfig, mode: str) -> dict:
    result = train(cfg, Context(), data_for(cfg), LoopOptions(step_mode=mode, test=False))
    assert result.step_mode == mode
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


@pytest.mark.parametrize("case", ["cifar-94", "cifar-94-muon", "mlp-space", "cnn-space"])
def test_the_program_equals_the_eager_step_over_an_epoch_boundary(case):
    # SGD, whose update is linear in the gradient: rounding apart, float32 moves a weight by ~1e-7.
    sgd = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "precision": "fp32"}
    cfg = config(CASES[case], **sgd)
    assert max_difference(run(cfg, "program"), run(cfg, "eager")) < 1e-6


@pytest.mark.parametrize("optimizer", list(SCHEDULES))
def test_one_step_of_the_program_equals_one_eager_step_for_every_optimizer(optimizer):
    cfg = config(CASES["mlp-space"], steps=1, optimizer=optimizer, lr=DEFAULT_LR[optimizer])
    program = run(cfg, "program")
    assert max_difference(program, run(cfg, "eager")) < 1e-6
    data = data_for(cfg)
    initial = build(cfg, data.input_shape, data.num_classes, Context()).state_dict()
    assert max_difference(program, initial) > 1e-4  # the step really moved the weights


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_whole_step_compiles_once_as_one_graph(case, aot_eager, monkeypatch):
    # fullgraph=True: a graph break is an error (and would fall back, which `run` rules out).
    # fail_on_recompile from the end of the warm-up: another compilation (an epoch, a Lookahead pull,
    # an evaluation, the schedule's next value) is an error, which the training loop does not catch.
    import torch._dynamo

    torch._dynamo.reset()  # no compilation of an earlier test's program counts
    prepare = StepProgram.prepare
    with contextlib.ExitStack() as after_warm_up:
        def prepare_then_forbid(self, *args):
            ran = prepare(self, *args)
            after_warm_up.enter_context(torch.compiler.set_stance("fail_on_recompile"))
            return ran

        monkeypatch.setattr(StepProgram, "prepare", prepare_then_forbid)
        cfg = config(CASES[case], steps=32, eval_every=7)  # 2 epochs and a bit, evaluations mid-epoch
        compiled = run(cfg, "compiled")  # asserts it ran compiled, not the fallback
    monkeypatch.undo()
    assert max_difference(compiled, run(cfg, "program")) < (1e-6 if cfg.optimizer == "sgd" else 1e-2)


class _HostReads(TorchDispatchMode):
    """Records the ops that read a device value back to the host (or make a tensor from host data)."""

    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::lift_fresh",
             "aten::lift_fresh_copy", "aten::item"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


class _HostCalls(TorchFunctionMode):
    """Records tensor methods that move data to the host (on a CPU they dispatch nothing)."""

    CALLS = {"cpu", "tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.CALLS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def program_for(cfg: TrainConfig, ctx: Context | None = None) -> StepProgram:
    ctx = ctx or Context()
    data = data_for(cfg)
    batches = Batches(data.x_train, data.y_train, ctx, cfg.batch_size, cfg.seed, "resident",
                      Normalizer(data.mean, data.std, ctx.device), augment_images=cfg.augment,
                      translate=cfg.translate)
    module = build(cfg, data.input_shape, data.num_classes, ctx)
    if hasattr(module, "fit_whitening"):
        module.fit_whitening(batches.normalize(batches.x[:500]))
    return StepProgram(module, cfg, ctx, batches, cfg.steps, torch.zeros((), device=ctx.device))


@pytest.mark.parametrize("case", ["mlp-space", "cifar-94", "cifar-94-muon"])
def test_a_steady_step_reads_nothing_back(case):
    # mlp: dropout (seeded on the host), crop+flip, a one-cycle schedule; whitenet: flip+translate,
    # Lookahead's pulls, two parameter groups, a linear schedule.
    cfg = config(CASES[case], steps=40)
    program = program_for(cfg)
    program.prepare("program", 0, print)
    walk = program.epoch(0, 0)
    next(walk)  # the epoch's start copies its permutation and salts in: once an epoch
    reads, calls = _HostReads(), _HostCalls()
    with reads, calls:
        for _ in range(8):
            next(walk)
    assert reads.seen == [] and calls.seen == []
    # The probe sees a read where there is one.
    with _HostReads() as probe, _HostCalls() as call_probe:
        float(program.worst), bool(program.t > 0)
    assert probe.seen and call_probe.seen


def test_state_keeps_its_memory_through_steps_epochs_the_warm_up_and_a_resume():
    cfg = config(CASES["cifar-94"], steps=40)
    program = program_for(cfg)
    addresses = [t.data_ptr() for t in program.tensors()]
    program.prepare("program", 0, print)
    for epoch in range(2):  # 15 steps an epoch: the second refills the permutation and salts in place
        for _ in program.epoch(epoch, 0):
            pass
    saved = copy.deepcopy(program.state_dict())
    program.load_state_dict(saved)
    assert [t.data_ptr() for t in program.tensors()] == addresses


def test_a_checkpoint_of_the_other_step_is_refused_in_one_line():
    from towerlab.training.progress import Progress, checkpoint_state

    cfg = config(CASES["mlp-space"], steps=4)
    state = checkpoint_state(cfg, Context(), Progress(step=2), program_for(cfg), 2)
    with pytest.raises(UserError, match="written by the step program.*resume with --input resident"):
        train(cfg, Context(), data_for(cfg), LoopOptions(step_mode="eager", test=False), resume_state=state)


def _rank(rank: int, world_size: int, store_path: str, args: list[str], mode: str, out: str) -> None:
    torch.set_num_threads(1)
    if mode == "compiled":
        towerlab.training.program.COMPILE_OPTIONS["cpu"] = {"backend": "aot_eager"}
    cfg, run_cfg = resolve_train(build_parser().parse_args(["train", *args]))
    with session(rank=rank, world_size=world_size, store_path=store_path, backend="gloo") as ctx:
        result = train(cfg, ctx, train_data(cfg, run_cfg, download=False), LoopOptions(step_mode=mode, test=False))
        assert result.step_mode == mode
        if ctx.is_main:
            torch.save({k: v.clone() for k, v in result.model.state_dict().items()}, out)


TWO_RANKS = [*TINY, "--model", "mlp", "--model-opt", "layers=2", "--model-opt", "neurons=32", "--optimizer", "sgd",
             "--lr", "0.05", "--steps", "6", "--augment"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["program", "compiled"])
def test_two_ranks_of_the_program_equal_one_rank_with_twice_the_batch(mode, tmp_path):
    # The program's own all-reduce (one flat buffer, functional collectives), compiled into the graph
    # too; dropout is seeded per rank, so this mlp has none.
    args = [*TWO_RANKS, "--model-opt", "dropout=0"]
    assert launch(_rank, 2, ([*args, "--batch-size", "32"], mode, str(tmp_path / "two.pt"))) == 0
    one = run(resolve_train(build_parser().parse_args(["train", *args, "--batch-size", "64"]))[0], "program")
    assert max_difference(torch.load(tmp_path / "two.pt", weights_only=True), one) < 1e-6


@pytest.mark.slow
def test_an_interrupted_compiled_run_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch, aot_eager):
    # Dropout seeded per step, crop+flip per example, one-cycle Adam: every host and device value a
    # resumed program must pick up where it stopped.
    args = [*RESUMABLE, *ONE_CPU, "--step", "compiled"]
    assert main(["train", *args, "--out", str(tmp_path / "whole")]) == 0
    interrupt(args, tmp_path / "cut", monkeypatch)
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert max_difference(weights(tmp_path / "cut"), weights(tmp_path / "whole")) == 0.0
    assert summary(tmp_path / "cut")["step"] == summary(tmp_path / "whole")["step"] == "compiled"


@pytest.mark.parametrize("flags,says", [
    (["--step", "graph"], "a CUDA graph needs a GPU"),
    (["--step", "compiled", "--strategy", "ps"], "--strategy ps sends gradients through the host"),
    (["--step", "compiled", "--input", "feed"], "gathers its batch from resident data")])
def test_a_step_that_cannot_run_here_is_refused_in_one_line(flags, says, tmp_path, capsys):
    assert main(["train", *TINY, *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and f"--step {flags[1]} cannot run here" in err, err
    assert not (tmp_path / "run").exists()
