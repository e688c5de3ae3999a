"""A search of your own training (issue 64): a function objective and a command objective each run a search of
30 trainings from the command line, whose rows carry the objective's values under its metric's name; the same
seed gives the same rows twice; a worker on a "second machine" (a folder and HOME of its own, a separate
`search worker` process against the store) joins each and writes rows equal to the one-process run's; a
command that exits 3 is one failed candidate with the tail of its stderr, and the search finishes. Then what
is refused (one line, exit 2, nothing written), what a worker is refused, resume, the views, the API."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from test_faults_search import wait_for
from towerlab.cli import main
from util import reaped, run_cli

QUAD = '''import os, random, time


def train(x, width, seed, epochs, folder, report):
    time.sleep(float(os.environ.get("QUAD_SLEEP", "0")))
    (folder / "seed.txt").write_text(str(seed))
    r = random.Random(seed)
    loss = (x - 0.3) ** 2 + 0.01 * width + 0.001 * r.random()
    for epoch in range(1, epochs + 1):
        report(epoch, loss=loss + 1.0 / epoch)
    return {"loss": loss + 1.0 / epochs, "acc": 1.0 - loss}
'''
TRAIN = '''import argparse, json, os, random, sys, time

p = argparse.ArgumentParser()
p.add_argument("--x", type=float)
p.add_argument("--width", type=int)
p.add_argument("--seed", type=int)
p.add_argument("--epochs", type=int)
a = p.parse_args()
time.sleep(float(os.environ.get("QUAD_SLEEP", "0")))
if (a.x, a.width) == (0.55, 3):
    print("training...", flush=True)
    print("boom: width 3 is too wide at 0.55", file=sys.stderr)
    sys.exit(3)
r = random.Random(a.seed)
loss = (a.x - 0.3) ** 2 + 0.01 * a.width + 0.001 * r.random()
for epoch in range(1, a.epochs + 1):
    print(json.dumps({"epoch": epoch, "loss": loss + 1.0 / epoch}))
print(json.dumps({"loss": loss + 1.0 / a.epochs, "acc": 1.0 - loss}))
'''
# 30 genomes: a search of 30 trainings is every one of them, once.
SPACE = '''[genes]
x = [0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95]
width = [1, 2, 3]
'''
COMMAND = shlex.join([sys.executable, "train.py", "--x", "{x}", "--width", "{width}", "--seed", "{seed}",
                      "--epochs", "{epochs}"])
ONE_CPU = ["--threads", "1", "--device", "cpu", "--devices", "1", "--no-progress"]
SEARCH = ["search", "run", "--metric", "loss", "--direction", "minimize", "--space", "space.toml", "--sampler",
          "random", "--population", "10", "--generations", "3", "--remeasure", "0", "--max-epochs", "3", "--seed", "5",
          *ONE_CPU]
KINDS = {"function": ["--objective", "quad.py:train"], "command": ["--command", COMMAND]}


def machine(folder: Path) -> Path:
    """A folder holding the objective's files, as a user's machine would."""
    folder.mkdir(parents=True)
    (folder / "quad.py").write_text(QUAD)
    (folder / "train.py").write_text(TRAIN)
    (folder / "space.toml").write_text(SPACE)
    (folder / "home").mkdir()
    return folder


def rows(store: Path) -> list[tuple]:
    """What decides a search's history, and what it recorded of each trial (worker and clocks aside)."""
    with contextlib.closing(sqlite3.connect(store)) as db:
        return sorted(db.execute("SELECT generation, idx, replicate, max_epochs, genome_hash, seed, status, fitness,"
                                 " metrics, curve, reason FROM evaluations"))


def trials_in(store: Path) -> int:
    """The rows a running search's store holds so far: none while its file or its tables are not there yet
    (the file exists a moment before the transaction that writes its schema commits)."""
    try:
        return len(rows(store)) if store.exists() else 0
    except sqlite3.OperationalError:
        return 0


def search(folder: Path, kind: str, out: str, *more: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = run_cli(*SEARCH, *KINDS[kind], "--out", out, *more, cwd=folder, env=env)
    assert done.returncode == 0, done.stderr
    return done


def start(folder: Path, *args: str, log: Path, env: dict) -> subprocess.Popen:
    """towerlab started in `folder`, its own process group, with `env` over this one's."""
    return subprocess.Popen([sys.executable, "-m", "towerlab", *args], cwd=folder, env={**os.environ, **env},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module", params=sorted(KINDS))
def reference(request, tmp_path_factory) -> tuple[str, Path, list[tuple]]:
    """A search of each kind, run twice in one process each with the same seed: the same rows twice."""
    folder = machine(tmp_path_factory.mktemp(request.param) / "one")
    search(folder, request.param, "a")
    search(folder, request.param, "b")
    first, second = rows(folder / "a" / "search.db"), rows(folder / "b" / "search.db")
    assert first == second and len(first) == 30
    return request.param, folder, first


@pytest.mark.slow
def test_an_objective_searches_30_trainings_whose_rows_carry_its_metric(reference):
    kind, folder, found = reference
    out = folder / "a"
    metrics = [json.loads(r[8]) for r in found if r[6] == "ok"]
    assert all(set(m) == {"loss", "acc"} for m in metrics)
    assert all(r[7] == -json.loads(r[8])["loss"] for r in found if r[6] == "ok")  # minimized: the fitness negated
    assert all(json.loads(r[9])[-1] == {"epoch": 3, "loss": json.loads(r[8])["loss"]} for r in found if r[6] == "ok")
    failed = [r for r in found if r[6] == "failed"]
    if kind == "command":  # one candidate exits 3: it failed, with its stderr's tail, and the search finished
        assert len(failed) == 1 and failed[0][10].startswith("exit status 3; stderr ends: boom: width 3 is too wide")
    else:
        assert failed == []
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["metric"], summary["direction"], summary["evaluations"], summary["failures"]) == (
        "loss", "minimize", 30, len(failed))
    assert summary["best_value"] == min(m["loss"] for m in metrics) == summary["best_metrics"]["loss"]
    assert summary["ended_by"] == "generations" and summary["cost"]["search"]["epochs"] == 90
    best = json.loads((out / "best.json").read_text())
    assert (best["value"], best["metric"], best["direction"]) == (summary["best_value"], "loss", "minimize")
    # each trial ran in a folder of its own, kept under the search's folder
    (search_trials,) = (out / "trials").glob("search-1-*")  # search-ID-TOKEN: unique to its store and search
    trials = list(search_trials.iterdir())
    assert len(trials) == 30 and all((trial / ("stdout.txt" if kind == "command" else "seed.txt")).is_file()
                                     for trial in trials)


def test_the_views_name_the_metric_and_its_direction(reference, capsys, monkeypatch):
    kind, folder, found = reference
    monkeypatch.chdir(folder)
    assert main(["search", "show", "a"]) == 0
    text = capsys.readouterr().out
    assert f"(your {kind} " in text and "; loss minimized)" in text and "rank       loss      +- seeds  genome" in text
    best = min(json.loads(r[8])["loss"] for r in found if r[6] == "ok")
    assert f"     1 {best:10.6g}       -     1  x=" in text and "test acc" not in text  # its metric, no test
    assert main(["search", "show", "a", "--csv"]) == 0
    records = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert {"metric_loss", "metric_acc", "gene_x", "gene_width"} <= set(records[0]) and len(records) == 30
    assert {float(r["metric_loss"]) for r in records if r["status"] == "ok"} == {
        json.loads(r[8])["loss"] for r in found if r[6] == "ok"}
    assert main(["search", "show", "a", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)[0]
    assert (record["metric"], record["direction"], record["value"]) == ("loss", "minimize", record["metrics"]["loss"])


@pytest.mark.slow
def test_a_worker_on_a_second_machine_joins_and_writes_the_rows_of_one_process(reference, tmp_path):
    """The job and a `search worker` started in another folder with a HOME of its own and its own copy of the
    objective's files, each trial slowed so that both take some: the rows are the one-process run's."""
    kind, _, found = reference
    one, two = machine(tmp_path / "one"), machine(tmp_path / "two")
    slow = {"QUAD_SLEEP": "0.4"}
    store = one / "out" / "search.db"
    job = start(one, *SEARCH, *KINDS[kind], "--out", "out", log=tmp_path / "job.log", env=slow)
    with reaped(job):
        wait_for(lambda: trials_in(store) > 0, timeout=120, what="the first trial")
        worker = start(two, "search", "worker", str(store), *KINDS[kind], "--device", "cpu", "--devices", "1",
                       log=tmp_path / "worker.log", env={**slow, "HOME": str(two / "home")})
        with reaped(worker):
            assert job.wait(timeout=300) == 0, (tmp_path / "job.log").read_text()
            assert worker.wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()
    assert rows(store) == found
    with contextlib.closing(sqlite3.connect(store)) as db:
        workers = {name.split(":")[1] for (name,) in db.execute("SELECT worker FROM evaluations")}
    assert str(worker.pid) not in workers and len(workers) == 2  # both trained (its crew's process, not itself)
    (search_trials,) = (two / "trials").glob("search-1-*")  # the worker's trials ran in its own folder
    joined = list(search_trials.iterdir())
    assert 0 < len(joined) < 30
    assert "nothing left to do" in (tmp_path / "worker.log").read_text()


@pytest.mark.slow
def test_an_objective_search_resumes_to_the_rows_of_one_run(reference, tmp_path):
    kind, _, found = reference
    folder = machine(tmp_path / "one")
    store = folder / "out" / "search.db"
    job = start(folder, *SEARCH, *KINDS[kind], "--out", "out", log=tmp_path / "job.log", env={"QUAD_SLEEP": "0.2"})
    with reaped(job):
        wait_for(lambda: trials_in(store) >= 5, timeout=120, what="5 trials")
        os.killpg(job.pid, signal.SIGTERM)
        assert job.wait(timeout=60) == 143, (tmp_path / "job.log").read_text()
    assert len(rows(store)) < 30
    done = run_cli("search", "run", "--resume", "out", cwd=folder)
    assert done.returncode == 0 and "resuming search 1" in done.stdout + done.stderr, done.stderr
    assert rows(store) == found


# -- what is refused -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, said", [
    (["--objective", "quad.py:nope"], "--objective quad.py:nope: quad.py defines no nope"),
    (["--objective", "quad.py:train", "--space", "depth.toml"], "--objective quad.py:train takes no gene 'depth'"),
    (["--command", "python train.py --x {x} --depth {depth} --width {width}"],
     "--command: {depth} names neither a gene of the space (x, width)"),
    (["--objective", "quad.py:train", "--space", "mlp"], "space mlp is of towerlab's mlp networks"),
    (["--objective", "quad.py:train", "--space", "model.toml"], "says model = 'mlp': the space of your own objective"),
    (["--objective", "quad.py:train", "--dataset", "cifar10"], "--dataset does nothing in a search of your own"),
    (["--objective", "quad.py:train", "--model", "quad.py:train"], "--model builds towerlab's networks"),
    (["--objective", "quad.py:train", "--command", "python train.py"], "--objective and --command both say"),
    (["--direction", "minimize"], "--direction goes with --objective or --command"),
    (["--metric", "loss"], "--metric goes with --objective or --command"),
    (["--objective", "quad.py:train", "--budget-epochs", "10", "--remeasure", "1", "--top", "5"],
     "--budget-epochs 10 leaves the search nothing once its top is re-measured"),
])
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch, flags, said):
    folder = machine(tmp_path / "one")
    (folder / "depth.toml").write_text("[genes]\nx = [0.1]\ndepth = [1, 2]\n")
    (folder / "model.toml").write_text('model = "mlp"\n[genes]\nneurons = [16]\n')
    monkeypatch.chdir(folder)
    space = [] if "--space" in flags else ["--space", "space.toml"]
    assert main(["search", "run", *space, *flags, *ONE_CPU, "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert not (folder / "out").exists()


def test_a_missing_metric_fails_each_trial_with_its_reason(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(machine(tmp_path / "one"))
    assert main([*SEARCH[:2], "--objective", "quad.py:train", "--metric", "nope", "--space", "space.toml",
                 "--sampler", "random", "--population", "2", "--generations", "1", *ONE_CPU, "--out", "out"]) == 2
    assert "all 2 candidates failed (the first: its result has no 'nope' (it has 'loss', 'acc')" in capsys.readouterr().err
    assert {r[6] for r in rows(Path("out") / "search.db")} == {"failed"}


def test_a_worker_is_refused_what_is_not_the_search_s_objective(reference, tmp_path, monkeypatch):
    """In order: a worker of towerlab's training, another kind, another metric or direction, other code (a
    function's file is compared by its bytes before it is imported: a file that would write a marker when
    imported writes none)."""
    kind, folder, _ = reference
    from towerlab.distributed.signals import StopFlag
    from towerlab.errors import UserError
    from towerlab.jobs.search.workers import Objectives
    from towerlab.objective.kind import Here
    from towerlab.objective.kind import Named as Own
    from towerlab.search import Search, Store
    import torch

    other = machine(tmp_path / "two")
    marker = tmp_path / "imported"
    (other / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n" + QUAD)
    spec = KINDS[kind][1]
    wrong = {"function": Own("command", COMMAND), "command": Own("function", "quad.py:train")}[kind]
    cases = [(wrong, f"it searches your own {kind} objective, and this worker runs a {wrong.kind}"),
             (Own(kind, spec, metric="acc"), "it searches loss (minimize), this worker acc (minimize)"),
             (Own(kind, spec, direction="maximize"), "it searches loss (minimize), this worker loss (maximize)")]
    if kind == "function":
        (other / "quad.py").write_text(QUAD.replace("0.3", "0.4"))
        cases += [(Own(kind, str(other / "quad.py:train")), "its objective's code differs here: quad differs"),
                  (Own(kind, str(other / "evil.py:train")), "its objective's code differs here: evil only here")]
    else:
        (other / "train.py").write_text(TRAIN.replace("0.3", "0.4"))
        cases.append((Own(kind, spec), "its objective's code differs here: ./train.py differs"))
    with Store(folder / "a" / "search.db", create=False) as store:
        found = Search.open(store, 1)
        monkeypatch.chdir(other)
        with StopFlag() as stop:
            for own, said in cases:
                with pytest.raises(UserError, match="^" + re.escape(said)):
                    Objectives(Here(torch.device("cpu"), named=own, stop=stop, trials=tmp_path / "trials")).objective(found)
            towerlab_worker = Objectives(Here(torch.device("cpu"), stop=stop))
            with pytest.raises(UserError, match="this worker runs towerlab's training: start it with"):
                towerlab_worker.objective(found)
    assert not marker.exists()


def quadratic(x, width, seed):
    """An objective given from Python (test_the_api_searches_a_function_given_from_python)."""
    return {"loss": (x - 0.3) ** 2 + 0.01 * width, "acc": 1 - x}


def test_the_api_searches_a_function_given_from_python_and_every_view_names_its_metric(tmp_path):
    """A function passed to towerlab.api.search (not FILE.py:FUNCTION): its rows, its record, TensorBoard, and
    the Optuna export (a minimized study whose values are the losses)."""
    pytest.importorskip("tensorboard")
    optuna = pytest.importorskip("optuna")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from towerlab import api

    out = tmp_path / "api"
    run = api.search({"x": {"low": 0.0, "high": 1.0}, "width": [1, 2]}, objective=quadratic, metric="loss",
                     direction="minimize", sampler="random", population=4, generations=2, max_epochs=2, remeasure=0,
                     device="cpu", devices=1, threads=1, progress=False, tensorboard=True, out=str(out))
    losses = [json.loads(r[8])["loss"] for r in rows(out / "search.db")]
    assert len(losses) == 8 and run.summary["best_value"] == run.best["value"] == min(losses)
    assert run.config["search"]["objective"].endswith("test_objective_search.py:quadratic")
    events = EventAccumulator(str(out / "tb")).Reload()
    assert {"search/loss", "search/best_loss"} <= set(events.Tags()["scalars"])
    assert events.Scalars("search/best_loss")[-1].value == pytest.approx(min(losses))
    assert main(["search", "export", str(out), "--optuna", f"sqlite:///{tmp_path / 'study.db'}"]) == 0
    study = optuna.load_study(study_name="api", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    assert sorted(t.value for t in study.trials) == sorted(losses) and study.best_value == min(losses)
    assert study.trials[0].user_attrs["metrics"]["acc"] == 1 - study.trials[0].params["x"]


@pytest.mark.slow
def test_the_page_s_example_runs_as_a_command_as_a_function_on_two_machines_and_on_a_budget(tmp_path, postgres_url):
    """docs/objectives.md, run as a reader runs it: its train.py and space.toml written out, then each of its
    towerlab commands in order (the PostgreSQL URL the tests' own server's), the two machines being two
    folders and the worker started once the search is under way."""
    from test_docs import blocks, towerlab_commands
    from util import REPO

    page = [(language, code) for language, code, _ in blocks(REPO / "docs" / "objectives.md")]
    script = next(code for language, code in page if language == "python" and "def train(" in code)
    space = next(code for language, code in page if language == "toml")
    commands = [argv for language, code in page if language == "bash" for argv in towerlab_commands(code)]
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        (folder / "train.py").write_text(script)
        (folder / "space.toml").write_text(space)
    # the page's commands run `python`, the interpreter on PATH: this one's, here
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    shown, job = [], None
    for argv in commands:
        argv = [postgres_url if word == "postgresql://towerlab@db-host/towerlab" else word for word in argv]
        if argv[:2] == ["search", "worker"]:
            assert job is not None, "the page starts the search before its worker"
            worker = start(two, *argv, "--devices", "1", log=tmp_path / "worker.log", env=env)
            with reaped(worker), reaped(job):
                assert job.wait(timeout=300) == 0, (tmp_path / "job.log").read_text()
                assert worker.wait(timeout=120) == 0, (tmp_path / "worker.log").read_text()
        elif "--store" in argv:  # the first machine's search: under way while the second machine joins it
            job = start(one, *argv, log=tmp_path / "job.log", env=env)
            wait_for(lambda: (one / "runs" / "two" / "config.json").exists(), timeout=120, what="the search")
        else:
            done = run_cli(*argv, cwd=one, env=env)
            assert done.returncode == 0, (argv, done.stderr)
            shown.append(done.stdout)
    command, function = rows(one / "runs" / "command" / "search.db"), rows(one / "runs" / "function" / "search.db")
    assert [r[:7] for r in command] == [r[:7] for r in function] and len(command) == 8
    assert [r[7] for r in command] == pytest.approx([r[7] for r in function], rel=1e-5)
    summary = json.loads((one / "runs" / "budget" / "summary.json").read_text())
    assert summary["ended_by"] == "budget_epochs" and summary["metric"] == "accuracy"
    assert any(text.startswith("id,search,sampler,") and "metric_accuracy" in text.splitlines()[0] for text in shown)


def test_only_a_search_whose_trials_run_in_its_workers_imports_torch_s_compiler_before_forking_them(
        tmp_path, monkeypatch):
    """A command's trials are processes of their own: its job's workers start without waiting on the import
    of torch's compiler front end that a function's (or towerlab's) trainings need."""
    from towerlab.jobs.search import job

    warmed: list[str] = []
    monkeypatch.setattr(job, "warm_up", lambda real=job.warm_up: warmed.append("warm") or real())
    monkeypatch.chdir(tmp_path)
    Path("xs.toml").write_text("[genes]\nx = [1, 2]\n")
    Path("f.py").write_text("def f(x):\n    return x\n")
    echo = shlex.join([sys.executable, "-c", "import sys; print(sys.argv[1])", "{x}"])
    assert main(["grid", "--command", echo, "--space", "xs.toml", "--remeasure", "0", *ONE_CPU, "--out", "c"]) == 0
    assert warmed == []
    assert main(["grid", "--objective", "f.py:f", "--space", "xs.toml", "--remeasure", "0", *ONE_CPU, "--out", "f"]) == 0
    assert warmed == ["warm"]


def test_a_search_whose_re_measures_repeat_its_values_says_that_re_measuring_it_is_wasted(tmp_path, capsys, monkeypatch):
    """An objective that answers the same whatever the seed: every re-measure of the top gives its network's value
    again, and the search says so once, at its end, with what would have saved them; one whose values follow the
    seed does not hear it."""
    monkeypatch.chdir(tmp_path)
    Path("xs.toml").write_text("[genes]\nx = [1, 2, 3]\n")
    Path("f.py").write_text("def same(x):\n    return x / 10\n\n\ndef seeded(x, seed):\n    return x / 10 + seed % 7 / 1000\n")
    grid = ["grid", "--space", "xs.toml", "--remeasure", "2", "--top", "2", *ONE_CPU]
    assert main([*grid, "--objective", "f.py:same", "--out", "same"]) == 0
    said = capsys.readouterr().out
    assert said.count("towerlab: note: each of the top's 4 re-measures gave its network's value again") == 1
    assert "--remeasure 0 would have saved them" in said
    assert [t["values"] for t in json.loads(Path("same/summary.json").read_text())["top"]] == [[0.3] * 3, [0.2] * 3]
    assert main([*grid, "--objective", "f.py:seeded", "--out", "seeded"]) == 0
    assert "re-measures gave" not in capsys.readouterr().out


def test_grid_runs_a_command_and_a_trial_past_its_timeout_fails_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("naps.toml").write_text("[genes]\nnap = [0, 30]\n")
    nap = shlex.join([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); print(1.5)", "{nap}"])
    assert main(["grid", "--command", nap, "--trial-timeout", "2", "--space", "naps.toml", "--remeasure", "0",
                 *ONE_CPU, "--out", "out"]) == 0
    with contextlib.closing(sqlite3.connect("out/search.db")) as db:
        by_nap = {json.loads(genome)["nap"]: (status, reason)
                  for genome, status, reason in db.execute("SELECT genome, status, reason FROM evaluations")}
    assert by_nap[0] == ("ok", None) and by_nap[30][0] == "failed"
    assert by_nap[30][1].startswith("timed out after 2 s, and was stopped")
    assert json.loads(Path("out/summary.json").read_text())["best_value"] == 1.5


CONTINUING = '''import argparse, json
from pathlib import Path


def train(x, width, epochs, folder, start, report):
    """Continues what it left in its folder: its result says from which epoch it went on, and its start."""
    state = Path(folder) / "state.json"
    found = json.loads(state.read_text())["epochs"] if state.exists() else 0
    for epoch in range(found + 1, epochs + 1):  # every epoch ranks the genomes as the last does
        report(epoch, acc=1 - (x - 0.3) ** 2 - 0.01 * width - 0.5 / epoch)
    state.write_text(json.dumps({"epochs": epochs}))
    return {"acc": 1 - (x - 0.3) ** 2 - 0.01 * width - 0.5 / epochs, "found": found, "start": start}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for name in ("--x", "--width", "--epochs", "--folder", "--start"):
        p.add_argument(name)
    a = p.parse_args()
    curve = []
    result = train(float(a.x), int(a.width), int(a.epochs), a.folder, int(a.start),
                   lambda epoch, **m: print(json.dumps({"epoch": epoch, **m})))
    print(json.dumps(result))
'''
CONTINUES = {"function": ["--objective", "cont.py:train"],
             "command": ["--command", shlex.join([sys.executable, "cont.py", "--x", "{x}", "--width", "{width}",
                                                  "--epochs", "{epochs}", "--folder", "{folder}", "--start", "{start}"])]}


@pytest.mark.parametrize("kind", sorted(CONTINUES))
def test_a_promotion_continues_in_its_lower_rung_s_folder_and_is_charged_the_rest(tmp_path, kind):
    """Issue 73: a pruned search's promoted trial runs in the folder its lower rung left (the genome's and
    seed's), is told the epochs it starts from, and its row records them as continued, which --budget-epochs
    does not charge again."""
    folder = machine(tmp_path / "m")
    (folder / "cont.py").write_text(CONTINUING)
    flags = [*SEARCH, *CONTINUES[kind], "--metric", "acc", "--direction", "maximize", "--max-epochs", "9",
             "--min-epochs", "1", "--out", "s"]
    done = run_cli(*flags, cwd=folder)
    assert done.returncode == 0, done.stderr
    with contextlib.closing(sqlite3.connect(folder / "s" / "search.db")) as db:
        found = db.execute("SELECT generation, genome_hash, seed, max_epochs, continued, metrics FROM evaluations"
                           " WHERE replicate = 0").fetchall()
        curves = db.execute("SELECT max_epochs, curve FROM evaluations WHERE replicate = 0").fetchall()
    # a continued trial reports the epochs it trained: its row's curve is the whole training's
    assert all([p["epoch"] for p in json.loads(curve)] == list(range(1, epochs + 1)) for epochs, curve in curves)
    trained = {(g, h, seed, e) for g, h, seed, e, _, _ in found}
    continued = [(g, h, seed, e, c) for g, h, seed, e, c, _ in found if c]
    assert len(continued) >= 3 and all(e > c for *_, e, c in continued)
    assert all((g, h, seed, c) in trained for g, h, seed, e, c in continued)  # its lower rung, this generation's
    for *_, c, metrics in found:  # what each trial found in its folder is what it was told, and recorded
        told = json.loads(metrics)
        assert told["found"] == told["start"] == c
    folders = {p.name for p in (folder / "s" / "trials").glob("search-1-*/*")}
    assert folders == {f"{h[:12]}-seed{seed}" for _, h, seed, _ in trained}
    with contextlib.closing(sqlite3.connect(folder / "s" / "search.db")) as db:
        given = db.execute("SELECT SUM(max_epochs - continued), SUM(max_epochs) FROM evaluations").fetchone()
    assert given[0] == sum(e for *_, e in trained) - sum(c for *_, c in continued) < given[1]


def test_a_pruned_search_of_an_objective_without_a_curve_probes_its_rungs_then_prunes(tmp_path):
    """Issue 73: an objective that returns its score alone gives its judge no curve; its rungs are probed (two
    generations trained at every rung, proposed before any probe was judged) and, where they rank as the
    last does, pruned at from then on. summary.json's `pruning` says how each rung was judged."""
    folder = machine(tmp_path / "m")
    (folder / "final.py").write_text("def train(x, width, epochs):\n"
                                     "    return {'acc': 1 - (x - 0.3) ** 2 - 0.01 * width - 0.5 / epochs}\n")
    flags = [*SEARCH, "--objective", "final.py:train", "--metric", "acc", "--direction", "maximize",
             "--max-epochs", "9", "--min-epochs", "1", "--out", "s"]
    (folder / "ranged.toml").write_text("[genes]\nx = {low = 0.0, high = 1.0}\nwidth = [1, 2, 3]\n")
    for flag, value in (("--population", "8"), ("--generations", "5"), ("--space", "ranged.toml")):
        flags[flags.index(flag) + 1] = value
    done = run_cli(*flags, cwd=folder)
    assert done.returncode == 0, done.stderr
    with contextlib.closing(sqlite3.connect(folder / "s" / "search.db")) as db:
        rows = db.execute("SELECT generation, max_epochs, COUNT(*) FROM evaluations WHERE replicate = 0"
                          " GROUP BY generation, max_epochs").fetchall()
    trained = {(g, e): n for g, e, n in rows}
    assert {e for g, e in trained if g < 2} == {9}  # no evidence yet: unpruned
    for g in (2, 3):  # probed: every member at every rung
        assert trained[g, 1] == trained[g, 3] == trained[g, 9] == 8
    assert trained[4, 1] == 8 and trained[4, 3] == 3 and trained[4, 9] == 1  # successive halving, factor 3
    pruning = json.loads((folder / "s" / "summary.json").read_text())["pruning"]
    assert [(v["rung"], v["used"], v["probed"]) for v in pruning] == [(0, True, False), (1, True, False)]
    assert all(v["pairs"] >= 16 and v["correlation"] == 1.0 for v in pruning)
    shown = run_cli("search", "show", "s", cwd=folder)
    assert shown.returncode == 0 and "rung 1 (1 epoch): rank correlation 1.00 over " in shown.stdout
    # search run says each new decision of the judge as the generations complete, and only those
    said = [line for line in done.stdout.splitlines() if line.startswith("Pruning, judged on the generations so far: ")]
    assert len(said) == 2 and "rung 1 (1 epoch): no learning curve reaches it, trained to see how it ranks (" \
        in said[0] and "rung 2 (3 epochs): rank correlation 1.00 over " in said[1] and said[1].endswith("pruning")
    again = run_cli("search", "run", "--resume", "s", cwd=folder)  # a resume shows them again, in order
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stdout.splitlines() if line.startswith("Pruning, judged on the generations so far: ")] \
        == said
