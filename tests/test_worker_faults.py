"""A worker process that dies says why, and one that ends while it holds a task is a death (issue 74, items 13,
14); fitness.png counts generations from 1 (item 17); and the messages of item 20, each one line that says
what is wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from towerlab.config import SearchConfig
from towerlab.distributed.crew import Crew, CrewFailed
from towerlab.errors import UserError


class Ended:
    """A crew's process that has ended (`exitcode`), as `Crew.watch` looks at one."""

    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode = pid, exitcode

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


def crew_of(ended: Ended, on_lost=lambda slot, pid, how: 0) -> tuple[Crew, list[str], list[int]]:
    """A crew (not started) whose one process has `ended`; what it logs, and the slots it starts again."""
    said: list[str] = []
    crew = Crew(lambda *args: None, 1, start_method="fork", on_lost=on_lost, log=said.append, patience=1)
    started: list[int] = []
    crew._start = started.append  # type: ignore[method-assign]  # a new process is not started here
    crew._procs = {0: ended}
    return crew, said, started


def test_a_worker_that_dies_of_an_error_says_which_in_the_crew_s_lines(tmp_path):
    """Its last words (`_speaking`, in the worker's process: here this one) beside the rendezvous store, read
    by the crew that sees it die."""
    from towerlab.distributed.crew import _speaking

    def bug(slot: int, slots: int, store_path: str) -> None:
        raise RuntimeError("a bug of towerlab's, say")

    crew, said, started = crew_of(Ended(os.getpid(), 1))
    with pytest.raises(RuntimeError):
        _speaking(0, 1, os.path.join(crew._reports, "store"), bug)
    crew.watch(0)
    assert said == [f"towerlab: warning: worker 0 (pid {os.getpid()}) exited with status 1 (RuntimeError: a bug of "
                    "towerlab's, say); starting another in its place"] and started == [0]
    crew.deaths = 1
    with pytest.raises(CrewFailed, match=r"\(the last, worker 0, pid \d+, exited with status 1 \(RuntimeError: a bug of "
                                         r"towerlab's, say\)\): giving up$"):
        crew.watch(0)
    crew.__exit__()


def test_a_worker_that_exits_0_holding_a_task_is_a_death_and_one_holding_none_has_left():
    held, said, started = crew_of(Ended(12345, 0), on_lost=lambda slot, pid, how: 1)  # os._exit(0) mid-task
    held.watch(0)
    assert started == [0] and not held.ended() and said[0].endswith("exited with status 0; starting another in its "
                                                                     "place")
    left, said, started = crew_of(Ended(12345, 0))  # it left by itself, holding nothing
    left.watch(0)
    assert started == [] and left.ended() and said == []
    held.__exit__()
    left.__exit__()


def test_fitness_png_counts_generations_from_1():
    from towerlab.plots import fitness_figure

    stats = [{"generation": g, "best": 0.9, "mean": 0.8, "worst": 0.7} for g in (1, 2, 3)]  # as records hold them
    fig = fitness_figure(stats, "search")
    try:
        assert [list(line.get_xdata()) for line in fig.axes[0].get_lines()] == [[1, 2, 3]] * 3
    finally:
        plt.close(fig)


def test_a_figure_leaves_out_what_no_axis_holds_and_says_so():
    from towerlab.plots import accuracy_time_figure, fitness_figure

    stats = [{"generation": 1, "best": 1e308, "mean": 0.0, "worst": -1e308}]
    records = [{"search": 1, "sampler": "grid", "max_epochs": 1, "replicate": 0, "seconds": 1.0, "status": "ok",
                "metric": "value", "direction": "maximize", "value": v} for v in (1e308, 0.5, -1e308)]
    for fig in (fitness_figure(stats, "search"), accuracy_time_figure(records, "search")):
        try:
            fig.savefig(os.devnull, format="png")  # it raised "arange: cannot compute length"
            assert [t.get_text() for t in fig.axes[0].texts] == ["2 value(s) beyond ±1e+300 not drawn"]
        finally:
            plt.close(fig)


# -- item 20: the messages -----------------------------------------------------------------------------------


def test_a_resume_names_the_flag_as_it_is_typed(tmp_path):
    from towerlab.settings import resolve_search

    (tmp_path / "out").mkdir()
    cfg = SearchConfig(trial_command="python tr.py {x}", space=str(tmp_path / "space.toml"))
    (tmp_path / "out" / "config.json").write_text(json.dumps({"kind": "search", "search": _dict(cfg),
                                                               "run": {"out": str(tmp_path / "out")}}))
    with pytest.raises(UserError, match=r"whose --command differ\(s\) from what you passed"):
        resolve_search("search", {"resume": str(tmp_path / "out"), "trial_command": "python other.py {x}"})
    resolved, _ = resolve_search("search", {"resume": str(tmp_path / "out"), "trial_timeout": 8})
    assert resolved.trial_timeout == 8


def _dict(cfg: SearchConfig) -> dict:
    from towerlab.fields import to_dict

    return to_dict(cfg)


def test_a_module_attribute_that_is_no_function_is_named_as_what_it_is(tmp_path):
    from towerlab.objective import FunctionObjective

    (tmp_path / "notfn.py").write_text("train = 3\n")
    with pytest.raises(UserError, match=r": train in .*notfn.py is a int, not a function: name the function to call$"):
        FunctionObjective(f"{tmp_path / 'notfn.py'}:train", [])


def test_an_empty_metric_is_refused_not_taken_for_none():
    from towerlab.objective import resolve

    with pytest.raises(UserError, match="^--metric '': give the name of the result's metric to search"):
        resolve(SearchConfig(objective="f.py:train", metric=""))


def test_a_small_budget_in_epochs_leaves_no_re_measure_rather_than_a_negative_one():
    from towerlab.search import Search, load_space

    space = load_space('{"genes": {"x": [1, 2, 3]}}', objective=True)
    for budget in (1, 5, 12):
        search = Search.resolve(SearchConfig(objective="f.py:train", budget_epochs=budget, max_epochs=3), space)
        assert search.cfg.remeasure == 0


def test_a_space_with_a_listed_gene_beside_a_range_is_said_continuous_in_the_range_alone():
    from towerlab.search import load_space

    space = load_space('{"genes": {"lr": {"low": 0.001, "high": 0.5, "log": true}, "width": [16, 32]}}', objective=True)
    assert space.size_text == "a space continuous in lr"


@pytest.mark.parametrize("given, warned", [
    (["--objective", "f.py:train"], "towerlab: warning: your f.py:train takes no epochs, and a pruned search trains each "
                                    "rung for its own epochs: each of its trials trains as long as any other"),
    (["--command", "python -c 'print(1)' {x}"], "towerlab: warning: your command names no {epochs}, and a pruned search "
                                                "trains each rung for its own epochs: unless the program reads "
                                                "$TOWERLAB_EPOCHS"),
])
def test_a_pruned_search_of_an_objective_that_takes_no_epochs_says_so_at_the_start(tmp_path, capsys, monkeypatch, given,
                                                                                    warned):
    from towerlab.cli import main

    monkeypatch.chdir(tmp_path)
    Path("f.py").write_text("def train(x):\n    return x\n")
    Path("space.toml").write_text("[genes]\nx = [1, 2, 3, 4]\n")
    assert main(["search", "run", *given, "--space", "space.toml", "--sampler", "random", "--population", "4",
                 "--generations", "1", "--min-epochs", "1", "--max-epochs", "3", "--remeasure", "0", "--threads", "1",
                 "--device", "cpu", "--devices", "1", "--no-progress", "--out", "out"]) == 0
    assert warned in capsys.readouterr().out
