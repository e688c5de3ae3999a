"""Several mlp networks trained in one step (bench/gpu/stacked.py, issue 57) end where their separate
trainings with the step program end, to rounding: their batched products (torch.baddbmm, torch.bmm)
sum each network's terms as its own products would, but MKL picks its kernels by shape and batch, and
for some shapes (a first layer of 784 x 32 at batch 64, here) the batched one rounds otherwise than
the single one: 1e-15 apart after a step in float64, where a network mixed with another, a wrong
mask, seed or rate moves a weight by 1e-3 or more."""

import dataclasses

import pytest
import torch

from towerlab.config import RunConfig, TrainConfig
from towerlab.distributed.group import Context
from towerlab.errors import UserError
from towerlab.jobs.train import train_data
from towerlab.models.preprocessing import Normalizer
from towerlab.training.batches import Batches
from towerlab.training.evaluation import loss_and_accuracy
from towerlab.training.loop import LoopOptions, train
from towerlab.training.network import build
from towerlab.training.program import StepProgram

from bench.gpu.stacked import stack_key, train_stacked

# Three networks of one shape with their own seeds, rates and optimizers (two share Adam), dropout
# 0.2, a one-cycle schedule: 2 epochs of 14 steps.
BASE = TrainConfig(model="mlp", model_options={"layers": 2, "neurons": 32, "activation": "tanh"},
                   dataset="synthetic", synthetic_train=1400, val_size=500, batch_size=64, epochs=2,
                   schedule="onecycle", label_smoothing=0.1)
OWN = [{"seed": 3, "optimizer": "adam", "lr": 0.003}, {"seed": 11, "optimizer": "sgd", "lr": 0.05},
       {"seed": 4, "optimizer": "adam", "lr": 0.001}]


class Float64(Normalizer):
    def __call__(self, x):
        return super().__call__(x).double()


def _separate_in_float64(cfg, data):
    """`cfg` trained alone by the step program, op by op, in float64."""
    ctx = Context()
    normalize = Float64(data.mean, data.std, ctx.device)
    batches = Batches(data.x_train, data.y_train, ctx, cfg.batch_size, cfg.seed, "resident", normalize)
    total = cfg.steps or cfg.epochs * batches.steps_per_epoch
    program = StepProgram(build(cfg, data.input_shape, data.num_classes, ctx).double(), cfg, ctx, batches, total,
                          torch.zeros((), dtype=torch.float64))
    for step in range(total):
        program.start(step)
        program.step(step)
    return program.module, normalize


def test_stacked_networks_end_where_their_separate_trainings_end_to_float64s_rounding():
    cfgs = [dataclasses.replace(BASE, **own) for own in OWN]
    assert len({stack_key(cfg) for cfg in cfgs}) == 1
    data = train_data(BASE, RunConfig(), download=False, log=lambda _: None)
    normalize = Float64(data.mean, data.std, torch.device("cpu"))
    stacked = train_stacked(cfgs, data, normalize=normalize, dtype=torch.float64)
    for cfg, result in zip(cfgs, stacked):
        alone, _ = _separate_in_float64(cfg, data)
        ours, theirs = result.model.state_dict(), alone.state_dict()
        assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) < 1e-12, cfg.seed
        val_loss, val_accuracy = loss_and_accuracy(alone, data.x_val, data.y_val, Context(), normalize)
        assert result.val_loss == pytest.approx(val_loss, abs=1e-12) and result.val_accuracy == val_accuracy
    start = build(cfgs[0], data.input_shape, data.num_classes, Context()).state_dict()
    assert max((stacked[0].model.state_dict()[k].float() - v).abs().max().item() for k, v in start.items()) > 1e-2
    assert len({r.val_loss for r in stacked}) == 3  # three different trainings, not one three times


def test_stacked_networks_in_float32_agree_with_separate_trainings_to_rounding():
    cfgs = [dataclasses.replace(BASE, **own, epochs=1) for own in OWN[:2]]
    data = train_data(BASE, RunConfig(), download=False, log=lambda _: None)
    stacked = train_stacked(cfgs, data, test=True)
    for cfg, result in zip(cfgs, stacked):
        alone = train(cfg, Context(), data, LoopOptions(step_mode="program", test=True))
        ours, theirs = result.model.state_dict(), alone.model.state_dict()
        assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) < 1e-5
        assert result.test_accuracy == pytest.approx(alone.test_accuracy, abs=0.005)


@pytest.mark.parametrize("change, says", [
    ({"model_options": {"layers": 1, "neurons": 32, "activation": "tanh"}}, "must share everything but"),
    ({"batch_size": 32}, "must share everything but")])
def test_trainings_that_differ_otherwise_are_not_stacked(change, says):
    with pytest.raises(UserError, match=says):
        train_stacked([BASE, dataclasses.replace(BASE, **change)], train_data(BASE, RunConfig(), download=False,
                                                                               log=lambda _: None))


def test_only_fp32_mlps_without_augmentation_are_stacked():
    cnn = dataclasses.replace(BASE, model="cnn", model_options={})
    with pytest.raises(UserError, match="mlp networks in fp32"):
        train_stacked([cnn], train_data(cnn, RunConfig(), download=False, log=lambda _: None))
