"""The proof of an objective is of what it runs (issue 74, items 1-7): a module a function imports inside
its body, the files a gene chooses in a command, the command's own text whatever its files are called,
what `python train.py` imports; a result recorded only if what its trial ran is still what its worker
proved; trial folders absolute and unique to their store and search; a genome read from the store checked
against the search's space before anything runs; the global random generators seeded per trial."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from test_faults_queue import reopened
from towerlab.objective import CommandObjective, Trial
from util import run_cli

ONE = ["--threads", "1", "--device", "cpu", "--devices", "1", "--no-progress"]
GRID = ["grid", "--space", "space.toml", "--remeasure", "0", "--max-epochs", "1"]
PYTHON = shlex.quote(sys.executable)


def sha(path: Path) -> str:
    return f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"


def write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def evaluations(store: Path, search: int | None = None) -> list[dict]:
    with contextlib.closing(sqlite3.connect(store)) as db:
        db.row_factory = sqlite3.Row
        found = [dict(r) for r in db.execute("SELECT * FROM evaluations ORDER BY id")]
    return [r for r in found if search is None or r["search_id"] == search]


def one_line(done: subprocess.CompletedProcess, *fragments: str) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("towerlab: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


# -- 1: a module a function imports inside its body ---------------------------------------------------------

LATE = {"f.py": "def f(x):\n    import helper2\n    return x + helper2.ADD\n", "helper2.py": "ADD = 0\n",
        "space.toml": "[genes]\nx = [1, 2, 3]\n"}


@pytest.mark.slow
def test_a_module_imported_inside_the_function_is_proven_and_its_edit_is_no_cache_hit(tmp_path):
    """A worker whose helper2.py adds 100 joined and recorded its rows; after helper2.py was edited, a new
    search on the same store served the old code's results from the cache ("evaluated 0, cached 3")."""
    folder = write(tmp_path, LATE)
    done = run_cli(*GRID, "--objective", "f.py:f", *ONE, "--out", "a", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert sorted(r["fitness"] for r in evaluations(folder / "a" / "search.db")) == [1, 2, 3]
    (folder / "helper2.py").write_text("ADD = 100\n")
    # the search's own job, resumed with the edited module, is refused as any worker is
    one_line(run_cli("search", "run", "--resume", "a", *ONE, cwd=folder), "its objective's code differs here: helper2 "
             "differs", "resume with the files it started with")
    done = run_cli(*GRID, "--objective", "f.py:f", *ONE, "--out", "b", "--store", "a/search.db", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert "evaluated 3, cached 0" in done.stdout + done.stderr
    assert sorted(r["fitness"] for r in evaluations(folder / "a" / "search.db", 2)) == [101, 102, 103]


def test_a_module_edited_before_a_trial_imports_it_records_nothing_of_that_trial(tmp_path):
    """The first trial edits helper2.py, then imports it: what it ran is not what the worker proved, so its
    result is dropped and the worker stops in one line (it was recorded under the search's proof)."""
    folder = write(tmp_path, {**LATE, "f.py": "from pathlib import Path\n\ndef f(x):\n"
                              "    Path('helper2.py').write_text('ADD = 100  # edited\\n')\n"
                              "    import helper2\n    return x + helper2.ADD\n"})
    done = run_cli(*GRID, "--objective", "f.py:f", *ONE, "--out", "a", cwd=folder)
    one_line(done, "search 1: what its trials run is no longer what this worker proved when it joined (helper2 "
             "differs (", "its result is dropped; put back the files the search was started with")
    assert evaluations(folder / "a" / "search.db") == []


# -- 2, 3, 4: what a command runs -----------------------------------------------------------------------------

TRAIN = """import json, sys
import helper

def main():
    from lib import config
    print(json.dumps({"value": float(sys.argv[-1]) + helper.ADD + config.load(sys.argv[1])}))

main()
"""
COMMAND_FILES = {"train.py": TRAIN, "helper.py": "ADD = 0\n", "lib/__init__.py": "",
                 "lib/config.py": "import json\n\ndef load(arg):\n"
                                  "    return json.load(open(arg.partition('=')[2]))['bias']\n",
                 "cfg/a.json": '{"bias": 0}', "cfg/b.json": '{"bias": 10}', "unused.py": "X = 1\n",
                 "space.toml": '[genes]\nc = ["a", "b"]\nx = [1, 2]\n'}


def test_a_command_s_proof_holds_the_files_its_genes_choose_and_what_its_program_imports(tmp_path, monkeypatch):
    monkeypatch.chdir(write(tmp_path, COMMAND_FILES))
    command = "python train.py --config=cfg/{c}.json --seed {seed} {x}"
    proof = CommandObjective(command, ["c", "x"], values={"c": ["a", "b"], "x": [1, 2]}).proof()
    assert {name: digest for name, digest in proof.parts.items() if name != "the command"} == {
        "./train.py": sha(tmp_path / "train.py"), "cfg/a.json": sha(tmp_path / "cfg/a.json"),
        "cfg/b.json": sha(tmp_path / "cfg/b.json"), "helper": sha(tmp_path / "helper.py"),
        "lib": sha(tmp_path / "lib/__init__.py"), "lib.config": sha(tmp_path / "lib/config.py")}
    as_module = CommandObjective("python -u -m lib.config {x}", ["x"], values={"x": [1, 2]}).proof()
    assert sorted(as_module.parts) == ["lib", "lib.config", "the command"]
    launched = CommandObjective("true --nproc-per-node 2 train.py {x}", ["x"]).proof()  # torchrun train.py, ...
    assert sorted(launched.parts) == ["./train.py", "helper", "lib", "lib.config", "the command"]


def test_a_file_named_command_is_a_file_and_the_command_s_text_stays_proven(tmp_path, monkeypatch):
    """`python command {x}` and `python command {x} --cheat` had one proof: the file named command took
    the part that held the command's text."""
    monkeypatch.chdir(write(tmp_path, {"command": "print(1)\n"}))
    plain = CommandObjective("python command {x}", ["x"]).proof()
    cheat = CommandObjective("python command {x} --cheat", ["x"]).proof()
    assert plain.parts["./command"] == cheat.parts["./command"] == sha(tmp_path / "command")
    assert cheat.difference(plain.parts).startswith("the command differs (")


def test_a_file_a_trial_names_is_checked_as_it_runs(tmp_path, monkeypatch):
    """A proven file edited since is not run; a file the proof lacks (one the program writes, as last.json, or
    one a float gene chose) is the program's own, not compared; a module of yours the proof lacks is."""
    monkeypatch.chdir(write(tmp_path, {"data/0.5.txt": "1", "run.txt": "1", "prog.py": "import late\n"}))
    objective = CommandObjective("python prog.py data/{x}.txt run.txt", ["x"], values={})
    assert sorted(objective.proof().parts) == ["./prog.py", "./run.txt", "the command"]
    assert objective.unproven(Trial({"x": 0.5}, 1, 1, "cpu", tmp_path / "t")) is None
    (tmp_path / "late.py").write_text("X = 1\n")  # not there when the proof was taken
    assert objective.unproven(Trial({"x": 0.5}, 1, 1, "cpu", tmp_path / "t")) == "late not in it"
    (tmp_path / "late.py").unlink()
    (tmp_path / "run.txt").write_text("2")
    assert objective.unproven(Trial({"x": 0.25}, 1, 1, "cpu", tmp_path / "t")) == (
        f"./run.txt differs ({sha(tmp_path / 'run.txt')[7:19]} now, {hashlib.sha256(b'1').hexdigest()[:12]} proven) "
        "(a file the program writes belongs in its trial's folder, {folder})")


@pytest.mark.slow
@pytest.mark.parametrize("edited, differs", [("cfg/b.json", "cfg/b.json differs"), ("lib/config.py", "lib.config "
                                             "differs"), ("helper.py", "helper differs")])
def test_a_command_search_refuses_a_worker_whose_chosen_or_imported_files_differ(tmp_path, edited, differs):
    folder = write(tmp_path, COMMAND_FILES)
    command = f"{PYTHON} train.py --config=cfg/{{c}}.json {{x}}"
    done = run_cli(*GRID, "--command", command, *ONE, "--out", "a", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert sorted(r["fitness"] for r in evaluations(folder / "a" / "search.db")) == [1, 2, 11, 12]
    (folder / edited).write_text((folder / edited).read_text().replace("0", "5") + "\n")
    one_line(run_cli("search", "run", "--resume", "a", *ONE, cwd=folder),
             f"its objective's code differs here: {differs}")


@pytest.mark.slow
def test_a_file_edited_while_a_command_search_runs_records_nothing_of_that_trial(tmp_path):
    """9 of 12 rows came from the edited file, under the first proof. Here the first trial's program edits
    the module its script imports: its result is dropped, the worker stops in one line."""
    edits = "open('helper.py', 'w').write('ADD = 100\\n')\n"
    folder = write(tmp_path, {**COMMAND_FILES, "train.py": TRAIN + edits})
    done = run_cli(*GRID, "--command", f"{PYTHON} train.py --config=cfg/{{c}}.json {{x}}", *ONE, "--out", "a",
                   cwd=folder)
    one_line(done, "search 1: what its trials run is no longer what this worker proved when it joined (helper differs",
             "its result is dropped")
    assert evaluations(folder / "a" / "search.db") == []


# -- 5: trial folders -----------------------------------------------------------------------------------------

CHDIR = """import os
from pathlib import Path

def f(x, folder):
    os.chdir(folder)
    left = Path("left.txt")
    again = left.exists()
    left.write_text(str(x))
    return x + 10 * again
"""


@pytest.mark.slow
def test_trial_folders_are_absolute_whatever_a_function_does_with_the_process_s_folder(tmp_path):
    """A function that does os.chdir(folder) nested every later trial's folder inside the one before."""
    folder = write(tmp_path, {"f.py": CHDIR, "space.toml": "[genes]\nx = [1, 2, 3, 4]\n"})
    done = run_cli(*GRID, "--objective", "f.py:f", *ONE, "--out", "a", cwd=folder)
    assert done.returncode == 0, done.stderr
    left = list((folder / "a" / "trials").rglob("left.txt"))  # each trial's in its own folder, none in another's
    assert [len(p.relative_to(folder / "a" / "trials").parts) for p in left] == [3, 3, 3, 3]
    assert sorted(p.read_text() for p in left) == ["1", "2", "3", "4"]
    assert sorted(r["fitness"] for r in evaluations(folder / "a" / "search.db")) == [1, 2, 3, 4]


CHECKPOINT = """import json, os, sys
from pathlib import Path
left = Path(sys.argv[2]) / "checkpoint.json"
found = json.loads(left.read_text()) if left.exists() else None
left.write_text(json.dumps({"store": os.environ["WHICH"]}))
print(json.dumps({"value": float(sys.argv[1]), "resumed_from": 1.0 if found == {"store": os.environ["WHICH"]}
                  else 2.0 if found else 0.0}))
"""


@pytest.mark.slow
def test_two_stores_searches_share_no_trial_folder_and_a_trial_tried_again_finds_its_own(tmp_path, monkeypatch):
    """Two stores whose searches have the same space and seed, their trials under one folder: search B's
    trials found A's checkpoint.json and recorded A's values."""
    import torch

    from towerlab.distributed.signals import StopFlag
    from towerlab.jobs.search.workers import Objectives
    from towerlab.objective.kind import Here, Named
    from towerlab.search import Candidate, Search, Store
    from towerlab.search.space import genome_hash
    from towerlab.search.work.objective import Assignment

    folder = write(tmp_path, {"ck.py": CHECKPOINT, "space.toml": "[genes]\nx = [1, 2]\n"})
    command = f"{PYTHON} ck.py {{x}} {{folder}}"
    for out in ("a", "b"):
        done = run_cli(*GRID, "--command", command, "--metric", "value", *ONE, "--out", out, cwd=folder,
                       env={"WHICH": out})
        assert done.returncode == 0, done.stderr
    monkeypatch.chdir(folder)
    candidate = Candidate(5, 0, {"x": 1}, genome_hash({"x": 1}), 7, 1)

    def trial(out: str) -> dict:
        monkeypatch.setenv("WHICH", out)
        with Store(folder / out / "search.db", create=False) as store, StopFlag() as stop:
            here = Here(torch.device("cpu"), named=Named("command", command), name="w", stop=stop, trials=Path("shared"),
                        store=store)
            return Objectives(here).objective(Search.open(store, 1))(Assignment(candidate)).metrics

    assert trial("a") == {"value": 1.0, "resumed_from": 0.0}
    assert trial("b") == {"value": 1.0, "resumed_from": 0.0}  # not A's checkpoint
    assert trial("a") == {"value": 1.0, "resumed_from": 1.0}  # tried again: what it left
    folders = sorted(p.name for p in (folder / "shared").iterdir())
    assert len(folders) == 2 and all(name.startswith("search-1-") for name in folders)


# -- 6: a genome read from the store --------------------------------------------------------------------------

SEEN = """import json, sys
open("argv.log", "a").write(json.dumps(sys.argv[1:]) + "\\n")
print(float(sys.argv[-1]))
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished command search of 4 genomes (its folder), copied and edited by the tests."""
    folder = write(tmp_path_factory.mktemp("finished"), {"seen.py": SEEN, "space.toml": '[genes]\nx = ["a", "b"]\n'
                                                        'n = [1, 2]\n'})
    done = run_cli(*GRID, "--command", f"{PYTHON} seen.py --x {{x}} {{n}}", *ONE, "--out", "search", cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder


@pytest.mark.parametrize("genome, reason", [
    ({"x": "--evil=/etc/shadow", "n": 1}, "its x is '--evil=/etc/shadow', not one of the space's values"),
    ({"x": {"nested": [1, 2]}, "n": 1, "extra": "zzz"}, "it has a gene 'extra' that the space has not"),
    ({"x": "a", "n": 2.0}, "its n is 2.0, not one of the space's values"),
    ("same hash, another genome", "it is not the genome its hash names"),
])
@pytest.mark.slow
def test_a_genome_edited_in_the_store_fails_its_trial_and_never_runs(tmp_path, finished, genome, reason):
    """{"x": "--evil=/etc/shadow"} became `tr.py --x --evil=/etc/shadow`, and was recorded as ok under the
    original genome's hash, so that the cache answered for a genome never trained."""
    shutil.copy(finished / "seen.py", tmp_path / "seen.py")
    folder = reopened(finished / "search", tmp_path)
    with contextlib.closing(sqlite3.connect(folder / "search.db")) as db, db:
        task, old = db.execute("SELECT id, genome FROM tasks WHERE state = 'open'").fetchone()
        if genome == "same hash, another genome":
            genome = {"x": "b" if json.loads(old)["x"] == "a" else "a", "n": json.loads(old)["n"]}
        db.execute("UPDATE tasks SET genome = ? WHERE id = ?", (json.dumps(genome), task))
        (hashed,) = db.execute("SELECT genome_hash FROM tasks WHERE id = ?", (task,)).fetchone()
    (tmp_path / "argv.log").unlink(missing_ok=True)
    done = run_cli("search", "worker", str(folder), "--command", f"{PYTHON} seen.py --x {{x}} {{n}}", *ONE[:-1],
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (row,) = [r for r in evaluations(folder / "search.db") if r["genome_hash"] == hashed]
    assert row["status"] == "failed" and row["reason"] == (
        f"its task's row gives a genome that is not its search's ({reason}): the row was edited, or written by "
        "another program")
    assert not (tmp_path / "argv.log").exists()  # the program never ran


# -- 7: the global random generators ---------------------------------------------------------------------------

DRAWS = """import random
import numpy as np
import torch

def f(x):
    return {"value": x + random.random() + float(np.random.rand()) + torch.rand(1).item(), "py": random.random()}
"""


@pytest.mark.slow
def test_a_function_drawing_from_the_global_generators_gives_the_same_rows_on_1_and_2_workers(tmp_path):
    """Both workers' streams started alike (forked), and went on from trial to trial: other rows on 2 workers
    than on 1."""
    import random

    folder = write(tmp_path, {"f.py": DRAWS, "space.toml": "[genes]\nx = [1, 2, 3, 4, 5, 6]\n"})
    found = []
    for devices in ("1", "2"):
        done = run_cli(*GRID, "--objective", "f.py:f", *ONE, "--devices", devices, "--out", devices, cwd=folder)
        assert done.returncode == 0, done.stderr
        found.append(sorted((r["genome_hash"], r["seed"], r["fitness"], r["metrics"])
                            for r in evaluations(folder / devices / "search.db")))
    assert found[0] == found[1] and len(found[0]) == 6
    for _, seed, _, metrics in found[0]:
        draws = random.Random(seed)
        draws.random()
        assert json.loads(metrics)["py"] == draws.random()  # Python's generator, seeded from the trial's seed
