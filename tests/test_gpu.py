"""The CUDA paths (issue 9): every input mode, both strategies over two ranks, bf16, checkpoint and
resume, a search packing two workers on one GPU, and the compiled step, each against the plain
result. Marked gpu and skipped without CUDA; on a GPU machine: python -m pytest -q -m gpu.

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

from towerlab.cli import build_parser, main, resolve_train
from towerlab.distributed import launch, session
from towerlab.runner import load_data
from towerlab.search import evaluation_records
from towerlab.train import train
from util import (ONE_GPU, RESUMABLE, TINY_DATA, interrupt, max_difference, metrics, small_space_file, summary,
                  weights)

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
    out = tmp_path_factory.mktemp("gpu") / "one"
    exact_float32()
    assert main(["train", *GPU, *SGD, "--batch-size", "64", "--out", str(out)]) == 0
    assert summary(out)["device_type"] == "cuda"
    return out


def _rank(rank: int, world_size: int, store_path: str, args: list[str], strategy: str, out: str) -> None:
    """One of `world_size` ranks sharing the first GPU, over gloo: NCCL allows one rank per GPU, so
    this is the search's --workers-per-device path (distributed.session's per_device). Rank 0 saves
    the trained weights to `out`."""
    exact_float32()
    torch.set_num_threads(1)
    cfg, run = resolve_train(build_parser().parse_args(["train", *args]))
    with session(rank=rank, world_size=world_size, store_path=store_path, backend="gloo", per_device=world_size,
                 device="cuda") as ctx:
        assert ctx.device == torch.device("cuda", 0)
        result = train(cfg, ctx, load_data(cfg, run, download=False), strategy=strategy, test=False)
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


@pytest.mark.slow
def test_the_compiled_step_on_cuda_equals_the_plain_step(one_gpu_double_batch, tmp_path, capsys):
    out = tmp_path / "compiled"
    assert main(["train", *GPU, *SGD, "--batch-size", "64", "--compile", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--compile failed" not in printed  # the fast step itself, not the fallback
    # Inductor's fused kernels sum in their own order: a looser bound than for the plain steps.
    assert max_difference(weights(out), weights(one_gpu_double_batch)) < 1e-4
    record = summary(out)
    assert record["setup_seconds"] > 0
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
    records = evaluation_records(tmp_path / "two" / "search.db")
    assert records and all(r["status"] == "ok" and r["worker"].endswith(":cuda:0") for r in records)
