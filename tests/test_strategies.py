"""The strategies and the step's other registries (issue 42): every registry names what its config list
names, a strategy is one class plus one registry line, and the checkpoint's layout stays what old
checkpoints hold."""

import os

import pytest
import torch

from towerlab import config
from towerlab.training import checkpoint, optim, update
from towerlab.config import TrainConfig
from towerlab.data.load import load_dataset
from towerlab.data.synthetic import SyntheticOptions
from towerlab.distributed.group import Context
from towerlab.training.step_kinds import STEP_KINDS
from towerlab.training.strategies import STRATEGIES, Strategy
from towerlab.training.loop import LoopOptions, train


def test_each_registry_names_exactly_its_config_list():
    assert set(STRATEGIES) == set(config.STRATEGIES)
    assert all(cls.name == name for name, cls in STRATEGIES.items())
    assert set(optim.OPTIMIZERS) == set(config.OPTIMIZERS)
    # The step program's form of each optimizer, and its default learning rate for a search.
    assert set(update.STATE) == set(optim.DEFAULT_LR) == set(config.OPTIMIZERS)
    assert [name for name in config.OPTIMIZERS if not hasattr(update.Update, "_" + name)] == []
    assert set(optim.SCHEDULES) == set(config.SCHEDULES)
    # --step's choices but auto (which resolve_step settles), and the tests' uncaptured program.
    assert set(STEP_KINDS) == set(config.STEPS) - {"auto"} | {"program"}


class AveragedAfterBackward(Strategy):
    """A strategy as a user adds one: the gradients all-reduced one tensor at a time after the backward."""

    name = "after-backward"

    def __init__(self, module, ctx, new_optimizer):
        super().__init__(module, ctx)
        self.optimizer = new_optimizer(self.params, ctx.device)

    def update(self, loss):
        self.optimizer.zero_grad()
        loss.backward()
        if self.ctx.distributed:
            for p in self.params:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(self.ctx.world_size)
        self.optimizer.step()

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def lr(self):
        return self.optimizer.lr()


@pytest.fixture(scope="module")
def data():
    return load_dataset("synthetic", val_size=200, synthetic=SyntheticOptions(train=1200))  # 1,000 to train on: 10 steps an epoch


# SGD with Nesterov momentum, weight decay, a linear schedule, BatchNorm's parameters on their own
# learning rate and Lookahead: every piece of the set-up a strategy is now handed instead of making.
CFG = TrainConfig(model="cnn", model_options={"filters": 8, "dense": 32}, dataset="synthetic", val_size=200,
                  batch_size=100, steps=20, optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                  schedule="linear", norm_lr_scale=4.0, lookahead=3)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ours, theirs = a.state_dict(), b.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_strategy_is_one_class_plus_one_registry_line(data, monkeypatch):
    reference = train(CFG, Context(), data, LoopOptions(strategy="ddp", step_mode="eager", test=False))
    monkeypatch.setitem(STRATEGIES, AveragedAfterBackward.name, AveragedAfterBackward)
    added = train(CFG, Context(), data, LoopOptions(strategy=AveragedAfterBackward.name, test=False))
    assert added.step_mode == "eager" and added.steps == 20
    # One process: the same arithmetic as DDP's, to the last bit.
    assert same_weights(added.model, reference.model) and added.val_loss == reference.val_loss


@pytest.mark.parametrize("strategy", ["ddp", "ps"])
def test_an_eager_checkpoint_keeps_its_layout_and_resumes(strategy, data, tmp_path):
    """{"model", "optimizer", "scheduler", "lookahead"}: what every eager checkpoint so far holds, so
    old checkpoints load; resumed from it, a run ends where the uninterrupted one did."""
    path = tmp_path / "checkpoint.pt"
    whole = train(CFG, Context(), data, LoopOptions(strategy=strategy, step_mode="eager", test=False,
                                                  checkpoint_path=path))
    os.replace(checkpoint.previous(path), tmp_path / "epoch1.pt")  # step 10's, replaced by step 20's
    state = checkpoint.load(tmp_path / "epoch1.pt", log=lambda _: None)
    saved = state["strategy"]
    assert (state["step"], sorted(saved)) == (10, ["lookahead", "model", "optimizer", "scheduler"])
    assert sorted(saved["optimizer"]) == ["param_groups", "state"] and len(saved["optimizer"]["param_groups"]) == 2
    assert saved["scheduler"]["last_epoch"] == 10 and saved["lookahead"]["steps"] == 10
    resumed = train(CFG, Context(), data, LoopOptions(strategy=strategy, step_mode="eager", test=False),
                    resume_state=state)
    assert resumed.steps == 20 and same_weights(resumed.model, whole.model)
