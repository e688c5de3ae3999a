"""A worker trusts no machine's word (`towerlab.objective.admission`, `towerlab.data.digest`): the data's content
(an .npz and the IDX files of the same data agree; one label changed does not), towerlab's version and
training code, torch's version and a model file's content are checked before a worker trains a search, and
a worker that differs is refused in one line naming what, exits 2 when it joined nothing, and trains
nothing; a model file is imported only where the worker's own command names it, never because the store
names it; a resume on other data is refused; every row records where it was trained. Searches on SQLite
here (the PostgreSQL side: test_search_postgres.py)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest

from test_code_digest import installed_copy
from test_data import mnist_like, write_idx_set
from test_faults_search import wait_for
from towerlab.data import digest
from towerlab.data.load import load_dataset
from util import ONE_CPU, SMALL_SPACE, reaped, run_cli, start_towerlab

pytestmark = pytest.mark.slow

SPACE = SMALL_SPACE
CUSTOM_SPACE = """
model = "custom"
[genes]
width = [8, 16, 32]
depth = [1, 2]
"""
NET = """
import torch.nn as nn


def make(input_shape, num_classes, width=8, depth=1):
    c, h, w = input_shape
    layers = [nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))
"""
# Each candidate: 2 epochs on 3,000 images of 28x28, a quarter of a second on one thread; 24 of them, so
# that a search stopped after its first is stopped long before its end, however busy the machine.
SEARCH = ["search", "run", "--sampler", "random", "--dataset", "mnist", "--val-size", "1000", "--max-epochs", "2",
          "--threads", "1", "--no-progress", "--population", "3", "--generations", "8", "--seed", "9", "--top", "2",
          *ONE_CPU]


def mnist_files(folder: Path, changed_label: bool = False, idx: bool = False) -> Path:
    """A small "mnist" of 4,000 + 500 images in `folder` (an .npz, or the four IDX files), the same arrays
    every time, or with one training label changed."""
    arrays = mnist_like(4000, 500, seed=3)
    if changed_label:
        arrays["y_train"][17] = (arrays["y_train"][17] + 1) % 10
    folder.mkdir(parents=True, exist_ok=True)
    if idx:
        write_idx_set(folder, arrays)
    else:
        np.savez(folder / "mnist.npz", **arrays)
    return folder


def test_the_digest_is_the_content_s_whatever_its_files(tmp_path, monkeypatch):
    """.npz and IDX files of the same arrays agree; one training label changed does not; the validation
    split does not change it; nothing is kept in the user's cache folder to answer for the files later."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    npz, idx, changed = (mnist_files(tmp_path / name, changed_label=name == "changed", idx=name == "idx")
                         for name in ("npz", "idx", "changed"))
    first = digest.content_digest(load_dataset("mnist", npz, 1000, download=False))
    assert first == digest.content_digest(load_dataset("mnist", idx, 500, download=False))
    assert first != digest.content_digest(load_dataset("mnist", changed, 1000, download=False))
    assert not (tmp_path / "cache").exists()


def killed_search(tmp_path: Path, *flags: str, data: Path, env: dict | None = None) -> Path:
    """A search on SQLite stopped (SIGKILL) after its first evaluation, unfinished in its store."""
    out = tmp_path / "search"
    space = tmp_path / ("custom.toml" if "--model" in flags else "space.toml")
    space.write_text(CUSTOM_SPACE if "--model" in flags else SPACE)
    os.environ.update({"TOWERLAB_DATA": str(data), **(env or {})})
    job = start_towerlab(*SEARCH, "--space", str(space), *flags, "--out", str(out), log=tmp_path / "job.log")
    with reaped(job):
        wait_for(lambda: rows(out), timeout=180, what="the first evaluation")
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    with sqlite3.connect(out / "search.db") as db:
        assert db.execute("SELECT finished FROM searches").fetchall() == [(None,)], "the search ended before its kill"
    return out


def rows(out: Path) -> list[tuple]:
    if not (out / "search.db").exists():
        return []
    try:
        with sqlite3.connect(out / "search.db") as db:
            return db.execute("SELECT worker, provenance FROM evaluations").fetchall()
    except sqlite3.OperationalError:  # its tables not made yet
        return []


def worker(out: Path, *flags: str, data: Path, python: str | None = None, env: dict | None = None,
           ) -> tuple[int, list[str]]:
    """`towerlab search worker OUT` on one CPU, its exit status and its stderr's lines; `python`: code run
    first in the worker's interpreter (another version, say); `env`: variables besides this process's."""
    args = ["search", "worker", str(out), *ONE_CPU, *flags]
    env = {**os.environ, "TOWERLAB_DATA": str(data), **(env or {})}
    import subprocess

    command = [sys.executable, "-c", f"{python or ''}\nimport sys\nfrom towerlab.cli import main\n"
                                     "sys.exit(main(sys.argv[1:]))", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, done.stderr.splitlines()


@pytest.mark.parametrize("python, said", [
    ("import towerlab; towerlab.__version__ = '0.2.0'",
     "it was started with towerlab 0.1.0, and this is towerlab 0.2.0, whose results may differ: install towerlab "
     "0.1.0 here"),
    ("import torch; torch.__version__ = '2.99.0'", "it was started with torch "),
    ("import towerlab.objective.admission as i; i.code_digest = lambda: 'sha256:0ther'",
     "towerlab's code here differs from the search's (digest 0ther, the search's "),
])
@pytest.mark.slow
def test_a_worker_on_other_software_is_refused_and_trains_nothing(tmp_path, python, said):
    """A worker whose towerlab was 0.2.0 joined and trained 2 candidates."""
    data = mnist_files(tmp_path / "data")
    out = killed_search(tmp_path, data=data)
    before = rows(out)
    status, lines = worker(out, data=data, python=python)
    assert status == 2 and len(lines) == 2 and lines[0].startswith("towerlab search worker: 1 worker(s)"), (
        lines, (tmp_path / "job.log").read_text()[-3000:], before)
    assert lines[1].startswith("towerlab: error: worker ") and f"joined no search of {out / 'search.db'}: search 1: " \
        f"{said}" in lines[1], lines
    assert rows(out) == before


def test_an_unedited_towerlab_installed_elsewhere_joins(tmp_path):
    """Another machine's venv: the same towerlab at another path, its .pyc files compiled as pip compiles
    them; its rows record the search's code digest."""
    data = mnist_files(tmp_path / "data")
    out = killed_search(tmp_path, data=data)
    before = rows(out)
    site = installed_copy(tmp_path / "elsewhere")
    status, lines = worker(out, data=data, python=f"import sys; sys.path.insert(0, {str(site)!r}); import towerlab; "
                                                  f"assert towerlab.__file__.startswith({str(site)!r})")
    assert status == 0 and lines[-1] == "towerlab search worker: nothing left to do", lines
    trained = rows(out)[len(before):]
    assert trained and {json.loads(p)["code"] for _, p in trained} == {json.loads(before[0][1])["code"]}


def test_a_worker_whose_torch_runs_other_cpu_kernels_is_refused(tmp_path):
    """Defect 9: ATEN_CPU_CAPABILITY=default changes a loss's last digits, and such a worker joined."""
    import torch

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch runs its DEFAULT kernels here: there is no lower capability to set")
    data = mnist_files(tmp_path / "data")
    out = killed_search(tmp_path, data=data)
    before = rows(out)
    status, lines = worker(out, data=data, env={"ATEN_CPU_CAPABILITY": "default"})
    ours = torch.backends.cpu.get_cpu_capability()
    assert status == 2 and lines[-1].endswith(
        f"search 1: its CPU workers' torch runs {ours} kernels, this one's DEFAULT, whose sums round otherwise: run "
        f"it where torch runs {ours} (ATEN_CPU_CAPABILITY={ours.lower()} lowers a CPU's to that)"), lines
    assert rows(out) == before and {json.loads(p)["cpu"] for _, p in before} == {ours}


def test_a_model_file_s_neighbour_is_proven_with_it(tmp_path):
    """Defect 5: net.py imports blocks.py beside it; a worker whose blocks.py differs joined, proven by net.py
    alone (0.9450 against 0.9524)."""
    data = mnist_files(tmp_path / "data")
    (tmp_path / "blocks.py").write_text("WIDTH = 8\n")
    net = tmp_path / "net.py"
    net.write_text("import blocks\n" + NET)
    out = killed_search(tmp_path, "--model", f"{net}:make", data=data)
    before = rows(out)
    (tmp_path / "blocks.py").write_text("WIDTH = 9\n")
    status, lines = worker(out, "--model", f"{net}:make", data=data)
    assert status == 2 and len(lines) == 2 and "search 1: the modules of yours that its model file imports differ " \
        "here (blocks differs (" in lines[-1], lines
    assert rows(out) == before
    done = run_cli("search", "run", "--resume", str(out), "--model", f"{net}:make", env={"TOWERLAB_DATA": str(data)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "the modules of yours that its model file " \
        "imports changed since it started (blocks differs (" in done.stderr, done.stderr
    (tmp_path / "blocks.py").write_text("WIDTH = 8\n")
    status, lines = worker(out, "--model", f"{net}:make", data=data)
    assert status == 0 and len(rows(out)) > len(before), lines


def test_a_worker_with_one_label_changed_is_refused_and_one_with_the_same_data_as_idx_finishes(tmp_path):
    data = mnist_files(tmp_path / "data")
    out = killed_search(tmp_path, data=data)
    before = rows(out)
    status, lines = worker(out, data=mnist_files(tmp_path / "other", changed_label=True))
    assert status == 2 and len(lines) == 2, lines
    assert "search 1: its data differ: mnist here (npz, " in lines[1] and "other/mnist.npz) holds content " in lines[1]
    assert rows(out) == before
    status, lines = worker(out, data=mnist_files(tmp_path / "idx", idx=True))
    assert status == 0, lines
    trained = rows(out)[len(before):]
    told = [line for line in lines if ": search 1, generation " in line and " in " in line]
    assert trained and lines[-1] == "towerlab search worker: nothing left to do", lines
    assert lines[-2].startswith("towerlab: worker ") and f" leaving after {len(told)} task(s) (0 failed) of " \
        "search(es) 1: " in lines[-2], lines
    assert sum("validation accuracy" in line for line in told) == len(trained), lines  # the others: test tasks
    where = [json.loads(p) for _, p in trained]
    assert {p["data"] for p in where} == {json.loads(before[0][1])["data"]}  # the IDX files hold the same
    assert all(p["host"] and p["towerlab"] == "0.1.0" and p["torch"] and p["device"] for p in where)


def test_a_resume_on_other_data_is_refused(tmp_path):
    data = mnist_files(tmp_path / "data")
    out = killed_search(tmp_path, data=data)
    done = run_cli("search", "run", "--resume", str(out), env={"TOWERLAB_DATA": str(mnist_files(
        tmp_path / "other", changed_label=True))})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"cannot resume search 1 of {out / 'search.db'}: its data differ: mnist here" in done.stderr


def test_a_worker_imports_a_model_file_only_where_its_command_names_it_and_its_content_is_the_search_s(tmp_path):
    """A worker imported the model file that the store named before any check (issue 60, defect 3), and
    took a file of the same path whatever its content (issue 56)."""
    data = mnist_files(tmp_path / "data")
    net = tmp_path / "net.py"
    net.write_text(NET)
    out = killed_search(tmp_path, "--model", f"{net}:make", data=data)
    before = rows(out)
    evil = tmp_path / "evil.py"
    marker = tmp_path / "evil-ran"
    evil.write_text(NET + f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    # the store's word alone: not imported
    status, lines = worker(out, data=data)
    assert status == 2 and "a worker imports only the model files its command names: start it with --model " \
        f"{net}:make" in lines[-1], lines
    # the same path, its content edited: refused before it is imported
    net.write_text(NET + f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    status, lines = worker(out, "--model", f"{net}:make", data=data)
    assert status == 2 and f"its model file differs: {net} here holds SHA-256 " in lines[-1], lines
    assert not marker.exists() and rows(out) == before
    done = run_cli("search", "run", "--resume", str(out), "--model", f"{net}:make", env={"TOWERLAB_DATA": str(data)})
    assert done.returncode == 2 and "its model file changed since it started" in done.stderr, done.stderr
    assert rows(out) == before
    marker.unlink()  # the resume's own command named the file: it imports it, as a training's --model does
    # a store edited to name another file (and that file's digest): a worker given the search's file trains
    # nothing of it, and imports neither
    net.write_text(NET)
    with sqlite3.connect(out / "search.db") as db:
        db.execute("UPDATE searches SET setup = json_set(setup, '$.model', ?, '$.model_sha256', ?)",
                   (f"{evil}:make", "sha256:" + __import__("hashlib").sha256(evil.read_bytes()).hexdigest()))
    status, lines = worker(out, "--model", f"{net}:make", data=data)
    assert status == 2 and "its model file differs" in lines[-1] and not marker.exists(), lines
    with sqlite3.connect(out / "search.db") as db:
        db.execute("UPDATE searches SET setup = json_set(setup, '$.model', ?, '$.model_sha256', ?)",
                   (f"{net}:make", "sha256:" + __import__("hashlib").sha256(net.read_bytes()).hexdigest()))
    status, lines = worker(out, "--model", f"{net}:make", data=data)
    assert status == 0 and len(rows(out)) > len(before), lines


def test_a_store_rewritten_to_a_model_file_of_its_choosing_runs_none_of_it(tmp_path):
    """Issue 60's defect 3 as it was seen: a search of mlp networks whose store is rewritten to name a model
    file; the worker ran the file's top level, and only then said "not joining"."""
    data = mnist_files(tmp_path / "data")
    out = killed_search(tmp_path, data=data)
    marker = tmp_path / "evil-ran"
    evil = tmp_path / "evil.py"
    evil.write_text(NET + f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    with sqlite3.connect(out / "search.db") as db:
        db.execute("UPDATE searches SET space = json_set(space, '$.model', 'custom'),"
                   " setup = json_set(setup, '$.model', ?)", (f"{evil}:make",))
    status, lines = worker(out, data=data)
    assert status == 2 and "a worker imports only the model files its command names" in lines[-1], lines
    assert not marker.exists()
    # named on the worker's own command line, the file is the user's choice to run: its networks are still
    # not the search's (the training settings' hash), so nothing is trained
    before = rows(out)
    status, lines = worker(out, "--model", f"{evil}:make", data=data)
    assert status == 2 and "its training settings differ" in lines[-1] and rows(out) == before, lines


FIXTURES = Path(__file__).parent / "fixtures"


def resumed_as_today(tmp_path: Path, schema: int) -> tuple[Path, tuple, str]:
    """The search folder of fixtures/store_v{schema}.sql and search_v{schema}.json (random, seed 4, one generation
    of 3 on synthetic data, as an older towerlab wrote it) in tmp_path/old, resumed to two generations, which
    end with the rows of the same search run whole today (in tmp_path/today): the old folder, its search's
    (setup, training hash) as the fixture holds them, and what the resume printed."""
    old = tmp_path / "old"
    old.mkdir()
    with sqlite3.connect(old / "search.db") as db:
        db.executescript((FIXTURES / f"store_v{schema}.sql").read_text())
        db.execute(f"PRAGMA user_version = {schema}")
        stored = db.execute("SELECT setup, train_config_hash FROM searches").fetchone()
    recorded = (FIXTURES / f"search_v{schema}.json").read_text().replace("{OUT}", str(old))
    (old / "config.json").write_text(recorded)
    resumed = run_cli("search", "run", "--resume", str(old), "--generations", "2")
    assert resumed.returncode == 0 and "resuming search 1" in resumed.stderr + resumed.stdout, resumed.stderr
    flags = json.loads(recorded)["command"][1:]
    flags[flags.index("--generations") + 1] = "2"
    flags[flags.index("--out") + 1] = str(tmp_path / "today")
    done = run_cli(*flags)
    assert done.returncode == 0, done.stderr
    decisive = "SELECT generation, idx, replicate, genome_hash, seed, status, fitness FROM evaluations ORDER BY 1, 2, 3"
    with sqlite3.connect(old / "search.db") as a, sqlite3.connect(tmp_path / "today" / "search.db") as b:
        assert a.execute(decisive).fetchall() == b.execute(decisive).fetchall()
        assert a.execute("PRAGMA user_version").fetchone()[0] == 8  # today's
    return old, stored, resumed.stdout


def test_a_search_of_schema_4_opens_resumes_and_ends_as_a_search_run_whole_today(tmp_path):
    """A search folder as towerlab wrote it before provenance (schema 4, made by e4ff269): it opens, migrated
    to today's schema, its rows without provenance; resumed to two generations, it ends with the rows of the same
    search run whole today, and `search show` tells the rows written before provenance from the new ones."""
    old, _, _ = resumed_as_today(tmp_path, 4)
    with sqlite3.connect(old / "search.db") as a:
        where = [p for (p,) in a.execute("SELECT provenance FROM evaluations ORDER BY id")]
    assert where[:3] == [None] * 3 and all(json.loads(p)["towerlab"] == "0.1.0" for p in where[3:]), where
    shown = run_cli("search", "show", str(old))
    assert shown.returncode == 0 and "its rows come from 2 provenances: 3 from no record of it (rows written before " \
        "towerlab kept one, " in shown.stdout, shown.stdout


def test_a_search_of_schema_5_by_the_previous_towerlab_resumes_on_its_data(tmp_path):
    """A search folder as the previous towerlab wrote it (schema 5, made by da77368): its data's digest is of
    the first formula (one SHA-256 over the arrays), and `--resume` said "its data differ" of the same data. It
    resumes (towerlab's code, which differs, adopted with a warning), its data's digest and training hash
    kept, migrated to schema 6 (its rows without an objective's metrics, its settings read as today's: no
    objective of yours, no budget in epochs), and ends with the rows of the same search run whole today."""
    old, (setup, stored_hash), said = resumed_as_today(tmp_path, 5)
    assert "towerlab: warning: resuming search 1 on other software (towerlab's code here differs" in said, said
    with sqlite3.connect(old / "search.db") as a, sqlite3.connect(tmp_path / "today" / "search.db") as b:
        assert a.execute("SELECT train_config_hash FROM searches").fetchone()[0] == stored_hash
        resumed = json.loads(a.execute("SELECT setup FROM searches").fetchone()[0])
        where = [json.loads(p) for (p,) in a.execute("SELECT provenance FROM evaluations ORDER BY id")]
        today = json.loads(b.execute("SELECT setup FROM searches").fetchone()[0])
    first = json.loads(setup)["data_digest"]
    assert resumed["data_digest"] == first != today["data_digest"]
    assert {p["data"] for p in where} == {first} and len(where) == 6
    with sqlite3.connect(old / "search.db") as a:
        assert a.execute("SELECT COUNT(*) FROM evaluations WHERE metrics IS NULL").fetchone()[0] == 6
        # the rows written before curves have none; today's trainings report their validation accuracy's
        curves = [json.loads(c) if c else None for (c,) in a.execute("SELECT curve FROM evaluations ORDER BY id")]
        assert curves[:3] == [None] * 3 and all(c and c[0]["epoch"] == 1 and "val_accuracy" in c[0] for c in curves[3:])
        config = json.loads(a.execute("SELECT config FROM searches").fetchone()[0])
    summary = json.loads((old / "summary.json").read_text())
    assert (summary["ended_by"], summary["generations"], summary["evaluations"]) == ("generations", 2, 6)
    assert (config["objective"], config["trial_command"], config["budget_epochs"]) == (None, None, None)
