"""A newcomer's own training searched from the command line (issue 74, items 8-20): trials that raise, end their
process or return what no float holds fail alone and the search ends; ±1e308 results are recorded, plotted and
resumed; a wrong metric stops the search after its first results and a resume names the right one without
training anything again; a hung search is given a timeout on resume; the views show the curves; and each
refusal is one line."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from towerlab.cli import main
from towerlab.errors import UserError
from towerlab.search.views.show import format_search
from util import reaped

ONE_CPU = ["--threads", "1", "--device", "cpu", "--devices", "1", "--no-progress"]
GRID = ["search", "run", "--sampler", "grid", "--remeasure", "0", *ONE_CPU]

FAULTS = '''import asyncio, os

class Mine(BaseException):
    pass

def train(x, report):
    report(1, loss=0.5 * x)
    if x == 0:
        raise asyncio.CancelledError("cancelled")
    if x == 1:
        return 10 ** 400
    if x == 2:
        raise Mine("mine")
    if x == 3:
        os._exit(3)
    if x == 4:
        os._exit(0)
    return {"value": float(x), "loss": 1.0 / x}
'''


def rows(store: Path) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(store)) as db:
        return sorted(db.execute("SELECT genome, status, reason, metrics, curve FROM evaluations"))


def test_trials_that_raise_or_end_their_process_fail_alone_and_the_search_ends(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("faults.py").write_text(FAULTS)
    Path("space.toml").write_text("[genes]\nx = [0, 1, 2, 3, 4, 5, 6]\n")
    assert main([*GRID, "--objective", "faults.py:train", "--space", "space.toml", "--out", "out"]) == 0
    found = {json.loads(genome)["x"]: (status, reason) for genome, status, reason, _, _ in rows(Path("out/search.db"))}
    assert [found[x][0] for x in range(7)] == ["failed"] * 5 + ["ok"] * 2
    assert found[0][1].endswith("CancelledError: cancelled") and found[2][1].endswith("Mine: mine")
    assert found[1][1] == "its value is inf (an integer beyond a float's range)"
    assert found[3][1].startswith("your train ended its worker's process at faults.py:")
    assert found[3][1].endswith(": it called os._exit(3)") and found[4][1].endswith(": it called os._exit(0)")
    assert json.loads(Path("out/summary.json").read_text())["best_value"] == 6.0
    capsys.readouterr()
    assert main(["search", "show", "out"]) == 0
    shown = capsys.readouterr().out
    assert "workers: 0 joined and not left, 1 left" in shown and "training search" not in shown


def test_results_of_plus_minus_1e308_are_recorded_plotted_and_resumed(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("big.py").write_text("def train(x):\n    return 1e308 if x > 1 else -1e308\n")
    Path("space.toml").write_text("[genes]\nx = [0, 1, 2, 3]\n")
    search = [*GRID, "--objective", "big.py:train", "--space", "space.toml", "--out", "out"]
    assert main(search) == 0
    out = capsys.readouterr().out
    assert "| best 1e+308 mean 0.0000 worst -1e+308 |" in out, out
    assert Path("out/fitness.png").stat().st_size > 0 and Path("out/accuracy_time.png").stat().st_size > 0
    assert json.loads(Path("out/summary.json").read_text())["best_value"] == 1e308
    assert main(["search", "run", "--resume", "out"]) == 0


def test_search_worker_refuses_trials_that_are_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("f.py").write_text("def train(x):\n    return x\n")
    Path("trials").write_text("a file")
    assert main(["search", "worker", "nowhere.db", "--objective", "f.py:train", "--trials", "trials"]) == 2
    assert capsys.readouterr().err == ("towerlab: error: --trials trials is a file, not a folder: give the folder where "
                                       "the trials of your objective keep theirs (it is made where it is not there)\n")


def test_a_store_truncated_by_a_trial_ends_the_search_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("trunc.py").write_text(
        "import os, sqlite3\ndef train(x):\n    if x:\n        db = sqlite3.connect('out/search.db')\n"
        "        db.execute('PRAGMA wal_checkpoint(TRUNCATE)')\n        db.close()\n"
        "        open('out/search.db', 'w').close()\n    return x\n")
    Path("space.toml").write_text("[genes]\nx = [0, 1, 2]\n")
    assert main([*GRID, "--objective", "trunc.py:train", "--space", "space.toml", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("towerlab: error: search store out/search.db is damaged (file is not a database)"), err
    assert err.count("\n") == 1


ACC = '''import os, time

def train(x, report):
    time.sleep(float(os.environ.get("NAP", "0")))
    with open("calls", "a") as f:
        f.write(f"{x}\\n")
    report(1, val_acc=x / 2)
    return {"val_acc": x, "loss": 1 - x}
'''


def test_a_wrong_metric_stops_the_search_and_a_resume_names_the_right_one_training_nothing_again(tmp_path, capsys,
                                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NAP", "0.3")  # so that the search stops before its last trial
    Path("acc.py").write_text(ACC)
    Path("space.toml").write_text("[genes]\nx = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]\n")
    assert main(["search", "run", "--objective", "acc.py:train", "--metric", "accuracy", "--space", "space.toml",
                 "--sampler", "random", "--population", "3", "--generations", "3", "--remeasure", "0", *ONE_CPU,
                 "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("towerlab: error: the first 4 trials of search 1 all failed the same way (the first: its "
                          "result has no 'accuracy' (it has 'val_acc', 'loss')") and err.count("\n") == 1, err
    assert "`towerlab search run --resume out --metric NAME`, NAME one of those its results hold ('loss', 'val_acc')" \
        in err
    trained = len(Path("calls").read_text().split())
    assert 4 <= trained < 9
    kept = rows(Path("out/search.db"))
    assert all(status == "failed" and set(json.loads(metrics)) == {"val_acc", "loss"} for _, status, _, metrics, _ in kept)
    assert main(["search", "run", "--resume", "out", "--metric", "val_loss", "--direction", "minimize"]) == 2
    assert capsys.readouterr().err.startswith("towerlab: error: cannot resume search 1 with --metric val_loss: none of "
                                              "its ")
    assert main(["search", "run", "--resume", "out", "--metric", "val_acc"]) == 0
    assert len(Path("calls").read_text().split()) == 9  # the trials that were kept were not trained again
    summary = json.loads(Path("out/summary.json").read_text())
    assert (summary["metric"], summary["best_value"], summary["failures"]) == ("val_acc", 0.9, 0)


def test_a_metric_named_like_a_loss_needs_its_direction(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("acc.py").write_text(ACC)
    Path("space.toml").write_text("[genes]\nx = [0.1]\n")
    assert main([*GRID, "--objective", "acc.py:train", "--metric", "val_loss", "--space", "space.toml", "--out",
                 "out"]) == 2
    assert capsys.readouterr().err == ("towerlab: error: --metric val_loss reads like a loss or an error, and a search "
                                       "maximizes its metric unless told (Optuna's default would minimize it): give "
                                       "--direction minimize, or --direction maximize if a higher value is better\n")
    assert not Path("out").exists()


def test_a_resume_gives_a_timeout_and_a_new_search_with_one_is_served_the_rows(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("acc.py").write_text(ACC)
    Path("space.toml").write_text("[genes]\nx = [0.1, 0.2]\n")
    search = [*GRID, "--objective", "acc.py:train", "--metric", "val_acc", "--space", "space.toml"]
    assert main([*search, "--out", "out"]) == 0
    assert main(["search", "run", "--resume", "out", "--trial-timeout", "5"]) == 0
    with contextlib.closing(sqlite3.connect("out/search.db")) as db:
        assert json.loads(db.execute("SELECT config FROM searches").fetchone()[0])["trial_timeout"] == 5
    capsys.readouterr()
    assert main([*search, "--trial-timeout", "8", "--store", "out/search.db", "--out", "again"]) == 0
    assert "Generation 1/1: evaluated 0, cached 2, failed 0" in capsys.readouterr().out
    assert len(Path("calls").read_text().split()) == 2


HANG = '''import os, time

def train(x):
    while not os.path.exists("go"):
        time.sleep(0.05)
    return x
'''


@pytest.mark.slow
def test_a_trial_at_work_is_shown_with_how_long_it_has_run(tmp_path):
    (tmp_path / "hang.py").write_text(HANG)
    (tmp_path / "space.toml").write_text("[genes]\nx = [1]\n")
    job = subprocess.Popen([sys.executable, "-m", "towerlab", *GRID, "--objective", "hang.py:train", "--space",
                            "space.toml", "--out", "out"], cwd=tmp_path, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with reaped(job):
        for _ in range(1200):
            with contextlib.suppress(UserError):  # no store yet, or its tables not yet
                shown = format_search(tmp_path / "out")
                if "training search 1" in shown:
                    break
            time.sleep(0.1)
        assert "training search 1, generation 1, member 0, for " in shown, shown
        (tmp_path / "go").touch()
        assert job.wait(timeout=120) == 0, job.stderr.read() if job.stderr else ""


def test_a_search_run_killed_with_sigkill_leaves_no_process_of_its_trials(tmp_path):
    """`search run` alone killed with SIGKILL (not its process group): its workers die with it (the parent-death
    signal), and every process of the trial they ran goes with them, a child in a session of its own too."""
    (tmp_path / "space.toml").write_text("[genes]\nx = [1]\n")
    hang = ("sh -c 'setsid sleep 300 & echo $! > {folder}/escaped; echo $$ > {folder}/leader; sleep 300 & wait' {x}")
    job = subprocess.Popen([sys.executable, "-m", "towerlab", *GRID, "--command", hang, "--space", "space.toml",
                            "--out", "out"], cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    with reaped(job):
        pids = []
        for name in ("leader", "escaped"):
            found = None
            for _ in range(1200):
                found = next((tmp_path / "out" / "trials").glob(f"*/*/{name}"), None)
                if found is not None and found.read_text().strip():
                    break
                time.sleep(0.1)
            assert found is not None, f"the trial never wrote its {name}"
            pids.append(int(found.read_text()))
        job.kill()  # the launcher alone
        job.wait()
        from towerlab.distributed.signals import alive

        for _ in range(400):
            if not any(alive(pid) for pid in pids):
                break
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids)


def test_the_views_show_the_curves_and_the_csv_has_no_column_of_towerlab_s_training(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    optuna = pytest.importorskip("optuna")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    Path("acc.py").write_text(ACC)
    Path("space.toml").write_text("[genes]\nx = [0.2, 0.4]\n")
    assert main([*GRID, "--objective", "acc.py:train", "--metric", "val_acc", "--space", "space.toml", "--tensorboard",
                 "--out", "out"]) == 0
    capsys.readouterr()
    assert main(["search", "show", "out", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert sorted(r["curve"][0]["val_acc"] for r in records) == [0.1, 0.2] and records[0]["objective"] == "function"
    assert main(["search", "show", "out", "--csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert not {"val_accuracy", "val_loss", "test_accuracy"} & set(table[0])
    assert sorted(r["curve"] for r in table) == ['[{"epoch": 1, "val_acc": 0.1}]', '[{"epoch": 1, "val_acc": 0.2}]']
    assert main(["search", "export", "out", "--optuna", f"sqlite:///{tmp_path / 'study.db'}"]) == 0
    study = optuna.load_study(study_name="out", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert sorted(t.intermediate_values[1] for t in study.trials) == [0.1, 0.2]
    assert all("val_loss" not in t.user_attrs for t in study.trials)
    tags = EventAccumulator("out/tb").Reload().Tags()["scalars"]
    assert sum(tag.startswith("curve/") and tag.endswith("/val_acc") for tag in tags) == 2


def test_a_command_naming_a_file_its_program_writes_is_resumed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("space.toml").write_text("[genes]\nx = [1, 2]\n")
    command = f"{sys.executable} -c 'import sys; open(sys.argv[1], \"w\").write(\"x\"); print(sys.argv[2])' last.json {{x}}"
    assert main([*GRID, "--command", command, "--space", "space.toml", "--out", "out"]) == 0
    assert Path("last.json").exists()
    assert main(["search", "run", "--resume", "out"]) == 0


def test_optuna_s_warnings_are_one_line_of_towerlab_s_each_said_once(capsys):
    import logging

    from towerlab.jobs.search.workers import optuna_lines

    optuna_lines()
    optuna_lines()
    for _ in range(3):
        logging.getLogger("optuna").warning("The optimization of kernel parameters failed: \nlinalg.cholesky: no.\n"
                                            "The default initial kernel parameters will be used instead.")
    assert capsys.readouterr().err == ("towerlab: warning: Optuna: The optimization of kernel parameters failed: "
                                       "linalg.cholesky: no. The default initial kernel parameters will be used "
                                       "instead.\n")
    assert os.getpid()
