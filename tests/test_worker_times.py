"""Where a search worker's time goes: towerlab's seam (jobs/search/worker_times.py, inert unless
$TOWERLAB_WORKER_CLOCK names a clock) and the benchmarks' clock behind it (bench/common/worker_times.py):
written only when asked for, one file per worker, its parts adding up to the worker's wall time."""

import json

import pytest

from towerlab.cli import main
from towerlab.errors import UserError
from towerlab.jobs.search import worker_times
from util import SEARCH_BASE, small_space_file, summary

from bench.common import worker_times as clock


@pytest.mark.slow
def test_a_search_workers_time_is_split_into_its_parts_when_asked(tmp_path, monkeypatch):
    folder = tmp_path / "times"
    for name, value in clock.environment(folder).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "search"
    args = [*SEARCH_BASE, "--devices", "2", "--space", small_space_file(tmp_path), "--population", "4",
            "--generations", "2", "--remeasure", "0", "--top", "1", "--out", str(out)]
    assert main(["evolve", *args]) == 0
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    assert len(records) == 2  # one per worker process
    trained = summary(out)["cost"]
    assert sum(r["tasks"] for r in records) == trained["search"]["trainings"] + trained["test"]["trainings"]
    for record in records:
        parts = record["seconds"]
        assert set(parts) == set(clock.PARTS) and min(parts.values()) >= 0.0
        assert sum(parts.values()) == pytest.approx(record["wall_seconds"])
        assert parts["start"] > 0.0 and parts["data"] > 0.0 and parts["store"] > 0.0
        if record["tasks"]:
            assert parts["training"] > 0.0 and parts["build"] > 0.0 and parts["evaluation"] > 0.0
        assert record["device"] == "cpu" and record["worker"].split(":")[2] == "cpu"  # host:pid:device:token


def test_nothing_is_imported_or_measured_unless_a_clock_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv(worker_times.ENV, raising=False)
    assert worker_times.from_env() is None
    monkeypatch.setenv(worker_times.ENV, f"{clock.__name__}:from_env")
    monkeypatch.delenv(clock.FOLDER, raising=False)
    assert worker_times.from_env() is None  # the benchmarks' clock, with no folder to write to: none
    monkeypatch.setenv(clock.FOLDER, str(tmp_path / "t"))
    times = worker_times.from_env()
    assert isinstance(times, clock.WorkerTimes) and times.folder == tmp_path / "t"
    assert clock.process_age() > 0.0  # this process started before the test


@pytest.mark.parametrize("named, says", [("no_such_module_here:make", "No module named 'no_such_module_here'"),
                                         (f"{clock.__name__}:nothing", "has no attribute 'nothing'"),
                                         (clock.__name__, "MODULE:NAME"), (f"{clock.__name__}:PARTS", "MODULE:NAME")])
def test_a_clock_that_cannot_be_made_is_one_line_naming_the_variable(named, says, monkeypatch):
    monkeypatch.setenv(worker_times.ENV, named)
    with pytest.raises(UserError, match=f"TOWERLAB_WORKER_CLOCK={named}: .*{says}"):
        worker_times.from_env()


def test_a_worker_tells_the_seconds_of_its_own_store_calls(tmp_path):
    from towerlab.config import SearchConfig
    from towerlab.search import Outcome, Search, load_space
    from towerlab.search.store import Store
    from towerlab.search.work.worker import Worker, WorkerOptions

    cfg = SearchConfig(sampler="random", population=2, generations=1, max_epochs=1, remeasure=0, top=1, seed=3)
    times = clock.WorkerTimes(tmp_path)
    calls = []

    def timed(name, seconds, started):
        calls.append(name)
        times.timed(name, seconds, started)

    with Store(tmp_path / "s.db") as store:
        search_id = Search.resolve(cfg, load_space("mlp")).create(store, "tch", {"test": False}).id
        Worker(store, "w", "cpu", lambda search: lambda assignment: Outcome.ok(0.5, epochs=1),
               WorkerOptions(search_ids=[search_id], timed=timed)).run()
    assert calls.count("complete") == 2 and calls.count("claim") >= 2 and set(calls) == {"claim", "complete"}
    assert times.seconds["store"] > 0.0 and times.first_claim is not None
