"""A pruned search's promotion continues its lower rung's training (issue 73): towerlab's own training leaves a
checkpoint in the trial folder at a rung below --max-epochs and goes on from it, to the result a training
started again gives; a training whose course depends on its length starts again, and says so."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from towerlab.config import SearchConfig
from towerlab.data.load import load_dataset
from towerlab.data.synthetic import SyntheticOptions
from towerlab.objective.candidate import CHECKPOINT, Rung, candidate_config, continuable, train_candidate
from towerlab.training import checkpoint

CPU = torch.device("cpu")
GENOME = {"layers": 1, "neurons": 16, "optimizer": "sgd"}


@pytest.fixture(scope="module")
def data():
    return load_dataset("synthetic", val_size=200, synthetic=SyntheticOptions(train=1200))


def trained(data, max_epochs, folder=None, starts=0):
    cfg = SearchConfig(dataset="synthetic", val_size=200, max_epochs=4, patience=2)
    outcome, _ = train_candidate(cfg, "mlp", GENOME, 11, data, CPU, rung=Rung(max_epochs, folder, starts))
    assert outcome.status == "ok", outcome.reason
    return outcome


def same(a, b) -> bool:
    """The same training: its fitness, loss and curve, bit for bit."""
    return (a.fitness, a.val_loss, a.curve, a.epochs) == (b.fitness, b.val_loss, b.curve, b.epochs)


def test_a_promotion_goes_on_from_its_lower_rung_to_what_a_restart_gives(data, tmp_path, monkeypatch):
    import towerlab.objective.candidate as candidate

    resumed = []

    def spied(*args, resume_state=None, **kw):
        resumed.append(None if resume_state is None else resume_state["step"])
        return train(*args, resume_state=resume_state, **kw)

    train = candidate.train
    monkeypatch.setattr(candidate, "train", spied)
    folder = tmp_path / "trial"
    low = trained(data, 1, folder=folder)
    assert low.continued == 0 and checkpoint.exists(folder / CHECKPOINT)
    assert checkpoint.load(folder / CHECKPOINT)["step"] > 0
    middle = trained(data, 2, folder=folder, starts=1)  # below the last rung: leaves its own
    assert middle.continued == 1 and checkpoint.load(folder / CHECKPOINT)["config"]["epochs"] == 2
    top = trained(data, 4, folder=folder, starts=2)  # the last rung: nothing left behind
    assert top.continued == 2 and not checkpoint.exists(folder / CHECKPOINT)
    per_epoch = resumed[1]
    assert resumed == [None, per_epoch, 2 * per_epoch] and per_epoch > 0  # each went on from the one below
    again = [trained(data, epochs) for epochs in (1, 2, 4)]
    assert [o.continued for o in again] == [0, 0, 0]
    assert all(same(a, b) for a, b in zip((low, middle, top), again))
    assert [p["epoch"] for p in top.curve] == [1, 2, 3, 4]  # the curve of the whole training


def test_a_promotion_without_its_folder_starts_again_and_is_charged_alike(data, tmp_path):
    """On another machine (no folder there), or with another training's checkpoint in it: from scratch, to
    the same result, charged the same (what --budget-epochs counts does not depend on who trained it)."""
    trained(data, 1, folder=tmp_path / "other")
    theirs = tmp_path / "other" / CHECKPOINT
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    state = checkpoint.load(theirs)
    checkpoint.save(mixed / CHECKPOINT, {**state, "config": {**state["config"], "lr": 0.5}})
    for folder in (tmp_path / "elsewhere", mixed):
        top = trained(data, 4, folder=folder, starts=1)
        assert top.continued == 1 and same(top, trained(data, 4))


def test_a_training_whose_course_depends_on_its_length_is_not_continued(data, tmp_path):
    cfg = candidate_config(SearchConfig(dataset="synthetic", max_epochs=4), "mlp", GENOME, 11, 1)
    assert continuable(cfg)
    assert not continuable(replace(cfg, schedule="onecycle")) and not continuable(replace(cfg, lookahead=5))
    assert not continuable(replace(cfg, steps=10))
    whitenet = candidate_config(SearchConfig(dataset="synthetic", max_epochs=4), "whitenet", {}, 11, 1)
    assert not continuable(whitenet)  # its recipe's schedule spans its length
