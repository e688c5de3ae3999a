"""A kind of objective is one module plus its line in the registry (`towerlab.objective.KINDS`), as a sampler
is: a kind registered here at test time (tests/echo_kind.py) runs a whole search from the command line, its
workers in processes of their own, its rows, record and views naming its metric and its kind; nothing in the
search, the job or the worker names a kind (`tests/test_layout.py` holds that)."""

from __future__ import annotations

import json

import pytest

from towerlab.cli import main
from towerlab.objective import KINDS
from towerlab.search import Store, evaluation_records

SPACE = "[genes]\na = [1, 2, 3]\nb = [10, 20]\n"
ONE_CPU = ["--threads", "1", "--device", "cpu", "--devices", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    # Its setting is --objective, the function kind's: the function kind stands aside while it is registered.
    monkeypatch.delitem(KINDS, "function")
    monkeypatch.setitem(KINDS, "echo", "echo_kind:Echo")  # the registry line


def test_a_kind_registered_at_test_time_runs_a_search(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text(SPACE)
    out = tmp_path / "out"
    assert main(["search", "run", "--objective", "x3", "--space", "space.toml", "--sampler", "grid", "--remeasure",
                 "0", "--top", "2", "--seed", "4", *ONE_CPU, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["metric"], summary["direction"], summary["objective"]) == ("value", "maximize", "x3")
    assert summary["evaluations"] == 6 and summary["best_value"] == 180.0  # 3 x 20 x 3
    assert [t["value"] for t in summary["top"]] == [180.0, 120.0]
    with Store(out / "search.db", create=False) as store:
        rows = evaluation_records(store)
    assert {r["objective"] for r in rows} == {"echo"} and len(rows) == 6
    assert sorted(r["value"] for r in rows) == [30.0, 60.0, 60.0, 90.0, 120.0, 180.0]
    assert all(r["metrics"]["seed"] == r["seed"] % 7 for r in rows)
    assert main(["search", "show", str(out)]) == 0
    assert "your echo x3" in capsys.readouterr().out


def test_a_worker_of_another_kind_is_refused_by_name(tmp_path, monkeypatch):
    import torch

    from towerlab.errors import UserError
    from towerlab.jobs.search.workers import Objectives
    from towerlab.objective.kind import Here, Named
    from towerlab.search import Search

    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text(SPACE)
    out = tmp_path / "out"
    assert main(["search", "run", "--objective", "x2", "--space", "space.toml", "--sampler", "grid", "--remeasure",
                 "0", "--top", "1", *ONE_CPU, "--out", str(out)]) == 0
    with Store(out / "search.db", create=False) as store:
        search = Search.open(store, 1)
        assert (search.aim.kind, search.aim.spec, search.goal.metric) == ("echo", "x2", "value")
        with pytest.raises(UserError, match="^it searches your own echo objective, and this worker runs a command: "
                                            "start it with --objective xN [(]the search's: x2[)]$"):
            Objectives(Here(torch.device("cpu"), named=Named("command", "true"))).objective(search)
        with pytest.raises(UserError, match="this worker runs towerlab's training: start it with --objective xN"):
            Objectives(Here(torch.device("cpu"))).objective(search)
        assert Objectives(Here(torch.device("cpu"), named=Named("echo", "x2"), store=store)).objective(search)
