"""--optimizer muon (Muon on the convolution filters, SGD on the rest) and --whiten-bias-epochs, the
two parts of airbench94_muon's recipe that the cifar-94 preset took (issue 57): Muon is PyTorch's
own on 2-D views of the filters, its own fallback equals it, and the whitening bias trains for its
first epochs only, after which the step program no longer computes its gradient."""

import math

import pytest
import torch

from towerlab.cli import build_parser, main
from towerlab.commands import resolve_train
from towerlab.distributed.group import session
from towerlab.distributed.launch import launch
from towerlab.config import RunConfig, TrainConfig
from towerlab.distributed.group import Context
from towerlab.jobs.train import train_data
from towerlab.models.preprocessing import Normalizer
from towerlab.training import muon
from towerlab.training.batches import Batches
from towerlab.training.loop import LoopOptions, train
from towerlab.training.network import build
from towerlab.training.program import StepProgram
import towerlab.jobs.train
from util import ONE_CPU, StopAtRead, max_difference, weights

HAS_TORCH_MUON = hasattr(torch.optim, "Muon")


def _filters(seed=0):
    """A wide filter laid out channels last, as whitenet's are, and a tall one (more rows than columns)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 4, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
    tall = torch.randn(12, 2, 1, 2, generator=g)
    return [wide, tall], g


@pytest.mark.skipif(not HAS_TORCH_MUON, reason="this torch has no torch.optim.Muon (2.9 and later)")
def test_filter_muon_is_torch_muon_on_each_filters_matrix():
    filters, g = _filters()
    ours = [f.clone().requires_grad_() for f in filters]
    # torch.optim.Muon over plain 2-D copies, their columns in the filters' memory order.
    theirs = [muon.matrix(f.clone()).contiguous().requires_grad_() for f in filters]
    optimizer = muon.FilterMuon(ours, lr=0.1, momentum=0.6, ns_steps=3, normalize=False)
    reference = torch.optim.Muon(theirs, lr=0.1, weight_decay=0.0, momentum=0.6, nesterov=True, ns_steps=3)
    for _ in range(4):
        grads = [torch.randn(f.shape, generator=g).contiguous(memory_format=torch.preserve_format) for f in filters]
        grads[0] = grads[0].contiguous(memory_format=torch.channels_last)  # as autograd lays out a channels-last one
        for p, q, grad in zip(ours, theirs, grads):
            p.grad, q.grad = grad, muon.matrix(grad, p).clone()
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
    assert all(torch.equal(muon.matrix(p.detach()), q.detach()) for p, q in zip(ours, theirs))
    assert all(p.grad is None for p in ours)  # zero_grad reaches the filters, not only their views
    assert ours[0].is_contiguous(memory_format=torch.channels_last)  # updated in place, in its own layout
    assert max_difference({"a": ours[0].detach()}, {"a": filters[0]}) > 1e-2


@pytest.mark.skipif(not HAS_TORCH_MUON, reason="this torch has no torch.optim.Muon (2.9 and later)")
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_fallback_for_an_older_torch_is_torch_muons_arithmetic(nesterov):
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(5, 9, generator=g, dtype=torch.float64), torch.randn(9, 4, generator=g, dtype=torch.float64)]
    ours, theirs = ([p.clone().requires_grad_() for p in start] for _ in range(2))
    settings = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov, "ns_steps": 4}
    optimizers = [muon._Muon2d(ours, **settings), torch.optim.Muon(theirs, **settings)]
    for _ in range(5):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            q.grad = p.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert not torch.equal(ours[1], start[1])


def _airbench_style_muon(filters, grads_per_step, lr, momentum, ns_steps):
    """airbench94_muon's Muon as its author describes it, written here as a reference: the momentum
    buffer sums the gradients (b = m b + g), Nesterov's look-ahead g + m b, each filter rescaled to
    norm sqrt(out) before its update, the update orthogonalised over its flattened (out, in*kh*kw)
    matrix after dividing it by its norm plus eps."""
    a, b, c = muon.NS_COEFFICIENTS
    params = [f.clone() for f in filters]
    buffers = [torch.zeros_like(f) for f in filters]
    for grads in grads_per_step:
        for p, buf, grad in zip(params, buffers, grads):
            buf.mul_(momentum).add_(grad)
            update = (grad + momentum * buf).reshape(len(grad), -1).bfloat16()
            x = update.T if update.size(0) > update.size(1) else update
            x = x / (x.norm() + 1e-7)
            for _ in range(ns_steps):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            x = x.T if update.size(0) > update.size(1) else x
            p.mul_(math.sqrt(len(p)) / p.norm())
            p.add_(x.float().view(p.shape), alpha=-lr)
    return params


def test_muon_with_normalize_is_airbench94_muons_step():
    # Their momentum sums where torch's averages (a factor 1 - momentum) and their orthogonalisation
    # divides by the norm plus eps where torch's divides by its clamp: the same steps up to bf16's
    # rounding of a scaled matrix. Wide filters (fewer output channels than inputs x kernel), as all of
    # whitenet's are: torch scales a tall one's rate by sqrt(rows / cols), airbench94_muon does not.
    g = torch.Generator().manual_seed(2)
    filters = [torch.randn(6, 4, 3, 3, generator=g), torch.randn(8, 8, 3, 3, generator=g)]
    grads_per_step = [[torch.randn(f.shape, generator=g) for f in filters] for _ in range(5)]
    reference = _airbench_style_muon(filters, grads_per_step, lr=0.24, momentum=0.6, ns_steps=3)
    ours = [f.clone().requires_grad_() for f in filters]
    unnormalized = [f.clone().requires_grad_() for f in filters]
    optimizers = [muon.FilterMuon(ours, 0.24, 0.6, 3, normalize=True),
                  muon.FilterMuon(unnormalized, 0.24, 0.6, 3, normalize=False)]
    for grads in grads_per_step:
        for optimizer, params in zip(optimizers, (ours, unnormalized)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            optimizer.step()
    close = max((p.detach() - q).abs().max().item() for p, q in zip(ours, reference))
    apart = min((p.detach() - q).abs().max().item() for p, q in zip(unnormalized, reference))
    assert close < 0.02 and apart > 1.0  # bf16's rounding, against what the rescaling changes


# --- training with them ----------------------------------------------------------------------------

SMALL = {"width1": 8, "width2": 16, "width3": 16}
# airbench94_muon's recipe (the cifar-94 preset's), small: 15 steps an epoch on 1,000 images of 16x16.
RECIPE = {"model": "whitenet", "model_options": SMALL, "dataset": "synthetic", "synthetic_shape": "3x16x16",
          "synthetic_train": 1200, "val_size": 200, "batch_size": 64, "optimizer": "muon", "lr": 0.3,
          "momentum": 0.85, "nesterov": True, "weight_decay": 0.005, "norm_lr_scale": 8.0, "schedule": "decay",
          "muon_lr": 0.24, "muon_momentum": 0.6, "muon_ns_steps": 3, "muon_normalize": True,
          "whiten_bias_epochs": 1, "label_smoothing": 0.2, "augment": True, "translate": 2}
RECIPE_FLAGS = ["--dataset", "synthetic", "--synthetic-shape", "3x16x16", "--synthetic-train", "600", "--val-size",
                "100", "--display-step", "1000", "--no-progress", "--threads", "1", "--model", "whitenet",
                *[a for k, v in SMALL.items() for a in ("--model-opt", f"{k}={v}")], "--optimizer", "muon", "--lr",
                "0.3", "--momentum", "0.85", "--nesterov", "--weight-decay", "0.005", "--norm-lr-scale", "8",
                "--schedule", "decay", "--muon-lr", "0.24", "--muon-momentum", "0.6", "--muon-ns-steps", "3",
                "--muon-normalize", "--whiten-bias-epochs", "1", "--label-smoothing", "0.2", "--augment",
                "--translate", "2", "--tta", "flip-translate"]


def _program(cfg):
    data = train_data(cfg, RunConfig(), download=False, log=lambda _: None)
    ctx = Context()
    batches = Batches(data.x_train, data.y_train, ctx, cfg.batch_size, cfg.seed, "resident",
                      Normalizer(data.mean, data.std, ctx.device, True), augment_images=True, translate=2)
    module = build(cfg, data.input_shape, data.num_classes, ctx)
    module.fit_whitening(batches.normalize(batches.x[:500]))
    return StepProgram(module, cfg, ctx, batches, cfg.steps, torch.zeros(()))


def test_the_whitening_bias_trains_its_first_epochs_and_its_gradient_is_not_computed_after():
    cfg = TrainConfig(**RECIPE, steps=40)  # 15 steps an epoch: frozen from step 15 on
    program = _program(cfg)
    program.prepare("program", 0, lambda line: None)
    module = program.module
    filters = next(m for m in module.modules() if isinstance(m, torch.nn.Conv2d)).weight
    computed = []
    module.whiten_bias.register_hook(lambda grad: computed.append(program.next_step))
    before, moved = (module.whiten_bias.detach().clone(), filters.detach().clone()), []
    for epoch in range(3):  # 40 steps: two epochs and 10 steps of the third
        for _ in zip(range(cfg.steps - len(moved)), program.epoch(epoch, 0)):
            now = (module.whiten_bias.detach().clone(), filters.detach().clone())
            moved.append((not torch.equal(now[0], before[0]), not torch.equal(now[1], before[1])))
            before = now
    # Its rate falls to 1/15 of its peak at step 14 (the 15th) and is 0 after.
    assert [bias for bias, _ in moved] == [True] * 15 + [False] * 25
    assert all(filters for _, filters in moved)
    assert computed == list(range(15))  # its gradient: in the first epoch's 15 steps, never after


def test_the_program_equals_the_eager_step_with_muon_and_the_whitening_bias_schedule():
    # Muon orthogonalises in bf16, where gradients that differ in their last float32 bits can round
    # apart, and from then on whole runs drift apart (1e-8 after 1 step, 2e-4 after 3, 3e-3 after 6
    # here). So: one step at the recipe's rate, then 5 steps (3 an epoch: the whitening bias frozen
    # from step 3) at a Muon rate too small for a rounding to matter, every other part as it is.
    for steps, muon_lr, bound in ((1, 0.24, 1e-6), (5, 1e-4, 1e-5)):
        cfg = TrainConfig(**{**RECIPE, "synthetic_train": 400, "muon_lr": muon_lr}, steps=steps)
        data = train_data(cfg, RunConfig(), download=False, log=lambda _: None)
        runs = {mode: train(cfg, Context(), data, LoopOptions(step_mode=mode, test=False)).model.state_dict()
                for mode in ("program", "eager")}
        assert max_difference(runs["program"], runs["eager"]) < bound
        start = build(cfg, data.input_shape, data.num_classes, Context()).state_dict()
        assert max_difference(runs["program"], start) > 0.01


def _rank(rank: int, world_size: int, store_path: str, args: list[str], out: str) -> None:
    torch.set_num_threads(1)
    cfg, run_cfg = resolve_train(build_parser().parse_args(["train", *args]))
    with session(rank=rank, world_size=world_size, store_path=store_path, backend="gloo") as ctx:
        result = train(cfg, ctx, train_data(cfg, run_cfg, download=False), LoopOptions(step_mode="program", test=False))
        if ctx.is_main:
            torch.save({k: v.clone() for k, v in result.model.state_dict().items()}, out)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ps", "program"])
def test_two_replicas_of_the_muon_recipe_equal_one_with_twice_the_batch(strategy, tmp_path):
    # After one step at the recipe's rate, what is not a filter is the same to float32's rounding
    # (gradients, BatchNorm over the global batch, the exchange) and the filters differ only where
    # bf16 rounded a gradient apart (1e-3 here); then 5 steps (3 an epoch at a global batch of 128,
    # the whitening bias frozen from step 3) at a Muon rate too small for such a rounding to matter.
    def two(steps: int, muon_lr: float) -> dict:
        args = [*RECIPE_FLAGS, "--steps", str(steps), "--muon-lr", str(muon_lr), "--device", "cpu", "--devices", "2",
                "--batch-size", "64"]
        out = tmp_path / f"two-{steps}"
        if strategy == "program":
            assert launch(_rank, 2, (args, str(out))) == 0
            return torch.load(out, weights_only=True)
        assert main(["train", *args, "--strategy", strategy, "--out", str(out)]) == 0
        return weights(out)

    def one(steps: int, muon_lr: float) -> dict:
        args = [*RECIPE_FLAGS, *ONE_CPU, "--steps", str(steps), "--muon-lr", str(muon_lr), "--batch-size", "128"]
        cfg, _ = resolve_train(build_parser().parse_args(["train", *args]))
        data = train_data(cfg, RunConfig(), download=False, log=lambda _: None)
        mode = "program" if strategy == "program" else "eager"
        return train(cfg, Context(), data, LoopOptions(step_mode=mode, test=False)).model.state_dict()

    first, first_two = one(1, 0.24), two(1, 0.24)
    filters = {k for k, v in first.items() if v.dim() == 4 and not k.startswith("whiten")}
    assert max_difference({k: first[k] for k in filters}, {k: first_two[k] for k in filters}) < 5e-3
    assert max_difference({k: v for k, v in first.items() if k not in filters},
                          {k: v for k, v in first_two.items() if k not in filters}) < 1e-5
    longer = one(5, 1e-4)
    assert max_difference(longer, two(5, 1e-4)) < 1e-5
    assert max_difference(longer, first) > 0.01


def test_an_interrupted_muon_run_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    # Muon's momentum (on the filters' views), the SGD side's, and the whitening bias's own schedule,
    # each part's optimizer and scheduler in the checkpoint; stopped after the freeze (7 steps an epoch).
    args = [*RECIPE_FLAGS, *ONE_CPU, "--steps", "12", "--batch-size", "64"]
    assert main(["train", *args, "--out", str(tmp_path / "whole")]) == 0
    StopAtRead.reads_before_stop = 9
    monkeypatch.setattr(towerlab.jobs.train, "StopFlag", StopAtRead)
    assert main(["train", *args, "--out", str(tmp_path / "cut")]) == 130
    monkeypatch.undo()
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert max_difference(weights(tmp_path / "cut"), weights(tmp_path / "whole")) == 0.0


@pytest.mark.parametrize("flags,says", [
    (["--model", "mlp", "--optimizer", "muon"], "--optimizer muon steps convolution filters"),
    (["--model", "lenet5", "--whiten-bias-epochs", "1"], "--whiten-bias-epochs trains the bias of a data-fitted"),
    (["--model", "whitenet", "--synthetic-shape", "3x16x16", "--muon-momentum", "1"], "--muon-momentum must be in"),
    (["--schedule", "decay", "--warmup", "0.1"], "--warmup needs --schedule onecycle or linear")])
def test_what_muon_and_the_whitening_bias_need_is_refused_in_one_line(flags, says, tmp_path, capsys):
    assert main(["train", "--dataset", "synthetic", *ONE_CPU, "--steps", "1", *flags, "--out",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "run").exists()
