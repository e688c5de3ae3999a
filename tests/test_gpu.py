"""The CUDA paths (issues 9 and 38): every input mode, both strategies over two ranks, bf16, checkpoint
and resume, a search packing two workers on one GPU, the step recorded as one CUDA graph (the default
of a one-GPU run) and compiled, each against the eager result, and steady steps that never wait for
the host. Marked gpu and skipped without CUDA; on a GPU machine: python -m pytest -q -m gpu.

Tolerances. Convolutions on a GPU do not sum in one fixed order: cuDNN picks its algorithm by
timing them (`cudnn.benchmark`), per batch shape, so two runs may round differently. The
comparisons below therefore train with SGD, whose update is linear in the gradient (Adam divides by
the gradient's own size and turns a rounding difference near zero into a step of the learning
rate), in float32 with TF32 off, for 6 steps: rounding then moves a parameter by about 1e-7, a
wrong exchange of gradients by about the learning rate times a gradient, 1e-3 or more.
"""

import json

import pytest
import torch

from towerlab.cli import build_parser, main
from towerlab.commands import resolve_train
from towerlab.distributed.group import session
from towerlab.distributed.launch import launch
from towerlab.jobs.train import train_data
from towerlab.search import evaluation_records
from towerlab.training.loop import LoopOptions, train
from util import (ONE_GPU, RESUMABLE, TINY_DATA, interrupt, max_difference, metrics, search_rows, small_space_file,
                  summary, weights)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason=f"needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() "
                                        "is False)")]

GPU = [*TINY_DATA, *ONE_GPU]
SGD = ["--model", "lenet5", "--steps", "6", "--optimizer", "sgd", "--lr", "0.05"]
TOLERANCE = 1e-5  # see the module docstring


def exact_float32() -> None:
    """Float32 convolutions and matrix products in float32, not TF32 (whose 10-bit mantissa would
    make batch 64 and two batches of 32 differ by 1e-3)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture(autouse=True)
def float32_arithmetic():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    exact_float32()
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def one_gpu_double_batch(tmp_path_factory):
    """The eager step: the input modes and strategies below run it too, so they compare paths of the
    same arithmetic (the step program's own comparisons follow)."""
    out = tmp_path_factory.mktemp("gpu") / "one"
    exact_float32()
    assert main(["train", *GPU, *SGD, "--batch-size", "64", "--step", "eager", "--out", str(out)]) == 0
    assert summary(out)["device_type"] == "cuda"
    return out


def _rank(rank: int, world_size: int, store_path: str, args: list[str], strategy: str, out: str) -> None:
    """One of `world_size` ranks sharing the first GPU, over gloo: NCCL allows one rank per GPU, so
    this is the search's --workers-per-device path (distributed.group.session's per_device). Rank 0 saves
    the trained weights to `out`."""
    exact_float32()
    torch.set_num_threads(1)
    cfg, run = resolve_train(build_parser().parse_args(["train", *args]))
    with session(rank=rank, world_size=world_size, store_path=store_path, backend="gloo", per_device=world_size,
                 device="cuda") as ctx:
        assert ctx.device == torch.device("cuda", 0)
        result = train(cfg, ctx, train_data(cfg, run, download=False), LoopOptions(strategy=strategy, test=False))
        if ctx.is_main:
            torch.save({k: v.cpu() for k, v in result.model.state_dict().items()}, out)


@pytest.mark.parametrize("strategy", ["ddp", "ps"])
def test_two_ranks_on_one_gpu_end_with_the_parameters_of_one_rank_with_twice_the_batch(
        strategy, one_gpu_double_batch, tmp_path):
    out = tmp_path / "weights.pt"
    args = [*GPU, *SGD, "--batch-size", "32"]
    assert launch(_rank, 2, (args, strategy, str(out))) == 0
    two = torch.load(out, weights_only=True)
    assert max_difference(two, weights(one_gpu_double_batch)) < TOLERANCE


def test_the_parameters_really_change(one_gpu_double_batch, tmp_path):
    # Guards the comparisons against two untrained models.
    assert main(["train", *GPU, *SGD, "--steps", "1", "--batch-size", "64", "--out", str(tmp_path / "short")]) == 0
    assert max_difference(weights(tmp_path / "short"), weights(one_gpu_double_batch)) > 100 * TOLERANCE


@pytest.mark.parametrize("mode", ["feed", "queue"])
def test_input_modes_on_cuda_compute_the_numbers_of_resident_data(mode, one_gpu_double_batch, tmp_path):
    out = tmp_path / mode
    assert main(["train", *GPU, *SGD, "--batch-size", "64", "--input", mode, "--out", str(out)]) == 0
    assert max_difference(weights(out), weights(one_gpu_double_batch)) < TOLERANCE
    assert summary(out)["input"] == mode


def test_parameter_server_alone_on_cuda_equals_all_reduce(one_gpu_double_batch, tmp_path):
    out = tmp_path / "ps"
    assert main(["train", *GPU, *SGD, "--batch-size", "64", "--strategy", "ps", "--out", str(out)]) == 0
    assert max_difference(weights(out), weights(one_gpu_double_batch)) < TOLERANCE


def test_bf16_autocast_on_cuda_learns_and_keeps_float32_weights(one_gpu_double_batch, tmp_path):
    out = tmp_path / "bf16"
    assert main(["train", *GPU, *SGD, "--batch-size", "64", "--precision", "bf16", "--out", str(out)]) == 0
    trained = weights(out)
    assert all(t.dtype == torch.float32 for t in trained.values())
    # bf16 products (8-bit mantissa) really were used, and stayed near the float32 run.
    assert 1e-6 < max_difference(trained, weights(one_gpu_double_batch)) < 1e-2
    longer = tmp_path / "longer"
    assert main(["train", *GPU, "--model", "lenet5", "--epochs", "2", "--batch-size", "64", "--precision", "bf16",
                 "--out", str(longer)]) == 0
    assert summary(longer)["test_accuracy"] > 0.5  # learnable synthetic data; chance is 0.1


def test_interrupted_then_resumed_on_cuda_equals_uninterrupted(tmp_path, monkeypatch):
    # Dropout (seeded per step on the GPU's generator), crop+flip, one-cycle Adam; every run warms up.
    args = [*RESUMABLE, *ONE_GPU]
    assert main(["train", *args, "--out", str(tmp_path / "whole")]) == 0
    interrupt(args, tmp_path / "cut", monkeypatch)
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    # The same kernels on the same inputs: equal, up to a library that picks another kernel after
    # the restart.
    assert max_difference(weights(tmp_path / "cut"), weights(tmp_path / "whole")) < 1e-6
    whole, cut = summary(tmp_path / "whole"), summary(tmp_path / "cut")
    assert cut["steps"] == whole["steps"] == 45 and cut["device_type"] == "cuda"
    assert [m["epoch"] for m in metrics(tmp_path / "cut") if m["kind"] == "epoch"] == [1, 2, 3]
    assert cut["setup_seconds"] > 0 and whole["setup_seconds"] > 0  # CUDA runs warm up


# The step program against the eager step: an MLP, whose gradients are smooth in the weights. (In
# LeNet-5 on synthetic uint8 images two pooled values can differ by less than a rounding of the
# update, which the program's update rounds otherwise than torch's fused kernel; a flipped maximum
# sends a gradient elsewhere, 1e-4 at the third step. The program against itself recorded or not
# is compared on LeNet-5 below.)
MLP = [*SGD, "--model", "mlp", "--model-opt", "layers=2", "--model-opt", "neurons=64"]


@pytest.mark.parametrize("args", [MLP, [*MLP, "--augment", "--schedule", "onecycle"]], ids=["mlp", "dropout-augment"])
def test_the_default_one_gpu_step_is_one_cuda_graph_and_equals_the_eager_step(args, tmp_path):
    # The mlp has dropout: the replay reads the generator seeded for its step, as the eager step does.
    for mode in ("eager", "auto"):
        assert main(["train", *GPU, *args, "--batch-size", "64", "--step", mode, "--out", str(tmp_path / mode)]) == 0
    assert summary(tmp_path / "auto")["step"] == "graph" and summary(tmp_path / "eager")["step"] == "eager"
    assert max_difference(weights(tmp_path / "auto"), weights(tmp_path / "eager")) < TOLERANCE


def test_the_recorded_program_equals_the_program_run_op_by_op(tmp_path):
    from towerlab.config import TrainConfig
    from towerlab.data.load import load_dataset
    from towerlab.data.synthetic import SyntheticOptions
    from towerlab.distributed.group import Context
    from towerlab.training.loop import LoopOptions, train

    data = load_dataset("synthetic", val_size=500, log=lambda _: None, synthetic=SyntheticOptions(train=2000))
    cfg = TrainConfig(model="lenet5", dataset="synthetic", synthetic_train=2000, val_size=500, steps=30, batch_size=64,
                      optimizer="adam", schedule="onecycle", lr=0.01, precision="bf16", label_smoothing=0.1)
    ctx = Context(device=torch.device("cuda", 0))
    torch.backends.cudnn.deterministic = True  # the same kernels in both runs
    try:
        runs = {mode: train(cfg, ctx, data, LoopOptions(step_mode=mode, test=False)) for mode in ("program", "graph")}
    finally:
        torch.backends.cudnn.deterministic = False
    assert runs["graph"].step_mode == "graph" and runs["program"].step_mode == "program"
    assert max_difference(runs["graph"].model.state_dict(), runs["program"].model.state_dict()) < 1e-6


def test_the_cifar94_recipes_two_recorded_programs_equal_the_program_run_op_by_op():
    # Muon on the filters and the whitening bias frozen after the first epoch (3 steps here): one graph
    # before the freeze and one after, against the program run op by op with the same kernels.
    from towerlab.config import TrainConfig
    from towerlab.data.load import load_dataset
    from towerlab.data.synthetic import SyntheticOptions
    from towerlab.distributed.group import Context
    from towerlab.presets import apply_preset

    recipe = {k: v for k, v in apply_preset("cifar-94", "cuda").items() if k not in ("dataset", "epochs", "val_size")}
    cfg = TrainConfig(**{**recipe, "dataset": "synthetic", "synthetic_shape": "3x16x16", "synthetic_train": 400,
                         "val_size": 200, "batch_size": 64, "steps": 8, "whiten_bias_epochs": 1,
                         "model_options": {"width1": 8, "width2": 16, "width3": 16}})
    data = load_dataset("synthetic", val_size=200, log=lambda _: None, synthetic=SyntheticOptions(train=400, shape=(3, 16, 16)))
    ctx = Context(device=torch.device("cuda", 0))
    torch.backends.cudnn.deterministic = True
    try:
        runs = {mode: train(cfg, ctx, data, LoopOptions(step_mode=mode, test=False)) for mode in ("program", "graph")}
    finally:
        torch.backends.cudnn.deterministic = False
    assert runs["graph"].step_mode == "graph" and runs["graph"].setup_seconds > 0
    assert max_difference(runs["graph"].model.state_dict(), runs["program"].model.state_dict()) < 1e-5


def test_steady_graph_and_program_steps_never_wait_for_the_host(tmp_path):
    from towerlab.models.preprocessing import Normalizer
    from towerlab.training.batches import Batches
    from towerlab.config import TrainConfig
    from towerlab.data.load import load_dataset
    from towerlab.data.synthetic import SyntheticOptions
    from towerlab.distributed.group import Context
    from towerlab.training.program import StepProgram
    from towerlab.training.network import build

    cfg = TrainConfig(model="mlp", dataset="synthetic", batch_size=64, steps=40, augment=True, schedule="onecycle",
                      lookahead=3, precision="bf16")
    data = load_dataset("synthetic", val_size=0, log=lambda _: None, synthetic=SyntheticOptions(train=64 * 20))
    ctx = Context(device=torch.device("cuda", 0))
    for mode in ("program", "graph"):
        batches = Batches(data.x_train, data.y_train, ctx, 64, 0, "resident", Normalizer(data.mean, data.std, ctx.device),
                          augment_images=True)
        steps = StepProgram(build(cfg, data.input_shape, 10, ctx), cfg, ctx, batches, 40, torch.zeros((), device=ctx.device))
        steps.prepare(mode, 0, print)
        walk = steps.epoch(0, 0)
        next(walk)  # the epoch's start copies its permutation over: a host copy, once an epoch
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):  # Lookahead's pulls included
                next(walk)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert steps.mode == mode


@pytest.mark.slow
def test_the_compiled_step_on_cuda_equals_the_eager_step(tmp_path, capsys):
    # Without dropout: inductor draws its own random numbers (the same for a step's seed, but not
    # the eager kernel's masks).
    for mode in ("eager", "compiled"):
        assert main(["train", *GPU, *MLP, "--model-opt", "dropout=0", "--batch-size", "64", "--step", mode,
                     "--out", str(tmp_path / mode)]) == 0
    printed = capsys.readouterr().out
    assert "--step compiled failed" not in printed  # the compiled step itself, not the fallback
    # Inductor's fused kernels sum in their own order: a looser bound than for the plain steps.
    out = tmp_path / "compiled"
    assert max_difference(weights(out), weights(tmp_path / "eager")) < 1e-4
    record = summary(out)
    assert record["step"] == "compiled" and record["setup_seconds"] > 0
    assert record["setup_seconds"] + record["train_seconds"] <= record["wall_seconds"]


@pytest.mark.slow
def test_a_search_with_two_workers_on_one_gpu_gives_the_history_of_one(tmp_path):
    base = ["evolve", "--dataset", "synthetic", "--val-size", "1000", "--max-epochs", "1", "--no-progress",
            *ONE_GPU, "--space", small_space_file(tmp_path), "--population", "4", "--generations", "2",
            "--remeasure", "0", "--seed", "3"]
    # One worker trains in this process, two in fresh ones: an MLP's matrix products run in float32
    # in both (TF32 is off by default for them), so their fitnesses agree exactly.
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    assert main([*base, "--workers-per-device", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("one", "two"))
    assert two["workers"] == 2 and two["device_type"] == "cuda" and two["failures"] == 0
    assert two["evaluations"] + two["cache_hits"] == 4 * 2

    def history(record: dict) -> list[dict]:
        return [{k: v for k, v in s.items() if "seconds" not in k} for s in record["generation_stats"]]

    assert history(two) == history(one)
    assert search_rows(tmp_path / "two") == search_rows(tmp_path / "one")  # every training, bit for bit
    records = evaluation_records(tmp_path / "two" / "search.db")
    assert records and all(r["status"] == "ok" and r["worker"].endswith(":cuda:0") for r in records)
    assert {r["device"] for r in records} == {torch.cuda.get_device_name(0)}
