"""A search on a cluster, as the docs give it: the install line that a worker needs, the help that names the
stores, and the Slurm scripts of docs/distributed-search.md (a job array of `search worker --wait`) and
docs/training.md (torchrun, one agent per node) submitted as the docs write them to a private Slurm cluster
(tests/slurm.py), with only their sizes changed for this machine. Each change is a text replaced in the
script, and each replaced text must be there: a script edited in the docs is the script tested."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from test_docs import blocks
from test_faults_search import wait_for
from test_search_provenance import mnist_files
from test_search_postgres import SEARCH, SPACE, decisive
from towerlab.search.store.schema import NoStore
from towerlab.search.store import Store
from util import REPO, reaped, run_cli, start_towerlab

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def script(page: str, marker: str, changes: dict[str, str]) -> str:
    """The shell block of docs/`page` that holds `marker`, with each of `changes` made (each must apply)."""
    [code] = [code for language, code, _ in blocks(REPO / "docs" / page) if language == "bash" and marker in code]
    for old, new in changes.items():
        assert code.count(old) == 1, f"docs/{page}'s script no longer holds {old!r}: update {__name__}"
        code = code.replace(old, new)
    return code


def extra(name: str) -> set[str]:
    """The packages an extra of towerlab installs, the extras it names included."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = set()
    for requirement in extras[name]:
        package = re.match(r"[A-Za-z0-9_.-]+", requirement)[0]
        if package == "towerlab":
            for named in re.search(r"\[(.*)\]", requirement)[1].split(","):
                found |= extra(named.strip())
        else:
            found.add(package)
    return found


def test_the_worker_install_of_the_docs_trains_every_sampler_on_either_store():
    """The docs' worker install was `towerlab[postgresql]`, and `search worker` then said that TPE, the
    default sampler, needs Optuna, and exited 2."""
    text = (REPO / "docs" / "distributed-search.md").read_text()
    [named] = re.findall(r"pip install 'towerlab\[(\w+)\]'", text)
    assert {"optuna", "psycopg"} <= extra(named)


def test_search_run_s_help_names_both_stores_and_the_variable():
    """`search run --help` called --store an "SQLite store" and named neither PostgreSQL nor $TOWERLAB_STORE."""
    done = run_cli("search", "run", "--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0 and "PostgreSQL" in text and "$TOWERLAB_STORE" in text and "SQLite store" not in text


# test_search_postgres's search, longer: the requeued array task starts again while it runs (Slurm takes
# seconds to start a requeued task: at 3 epochs a training, the whole search once ended in 10 s, before it)
LONG_SEARCH = [*SEARCH, "--generations", "20", "--max-epochs", "12"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("reference")
    (folder / "space.toml").write_text(SPACE)
    done = run_cli(*LONG_SEARCH, "--space", str(folder / "space.toml"), "--out", str(folder / "search"))
    assert done.returncode == 0, done.stderr
    return folder


def submit(cluster, folder: Path, text: str, env: dict) -> str:
    """`sbatch` of the script `text` from `folder`, with `env` (the job's environment); the job's id."""
    path = folder / "job.sbatch"
    path.write_text(text)
    done = cluster.run("sbatch", "--parsable", f"--chdir={folder}", str(path), env=env)
    return done.stdout.strip().split(";")[0]


def running(cluster, job: str) -> list[str]:
    """The array tasks (their index) of `job` that run now."""
    return cluster.run("squeue", "-h", "-j", job, "-t", "R", "-o", "%K").stdout.split()


def array_task(pid: int) -> str | None:
    """The Slurm array task that process `pid` runs in (None: none, or it is gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"SLURM_ARRAY_TASK_ID=")]
    return found[0] if found else None


def training(url: str, skip: set[str]) -> dict[str, str]:
    """The workers of Slurm array tasks (not in `skip`) that hold a task now: array task -> worker."""
    try:
        with Store(url, create=False) as store:
            held = {w["id"]: int(w["pid"]) for w in store.queue.workers() if w["task"] is not None and w["left_at"] is None}
    except NoStore:  # the search has not made its tables yet
        return {}
    found = {}
    for worker, pid in held.items():
        task = array_task(pid)
        if task is not None and task not in skip:
            found[task] = worker
    return found


class ArrayLogs:
    """The logs of a submitted job array's tasks (`name`: their file name with JOB and TASK for the ids), once
    each of its workers waits for a search: `said(task, what)` counts `what` in a task's log."""

    def __init__(self, folder: Path, name: str, job: str, tasks: str) -> None:
        self.files = {task: folder / name.replace("JOB", job).replace("TASK", task) for task in tasks}
        wait_for(lambda: all(self.said(task, "waiting for a search to start") for task in self.files), timeout=180,
                 what="the array's workers to wait for a search")

    def said(self, task: str, what: str) -> int:
        return self.files[task].read_text().count(what) if self.files[task].exists() else 0

    def text(self) -> str:
        return "".join(log.read_text() for log in self.files.values())


@pytest.mark.slow
def test_the_docs_job_array_of_workers_runs_a_search_through_a_cancel_and_a_requeue(
        tmp_path, reference, postgres_url, slurm_cluster):
    """The job array of docs/distributed-search.md (3 tasks of one CPU worker each here), submitted before
    the search: its workers wait for it, join it, one array task is cancelled and another requeued while
    each trains a candidate (their tasks go back on the queue), the requeued task joins again, and the
    search ends with the rows of the same search run alone on SQLite."""
    text = script("distributed-search.md", "#SBATCH --gres", {
        "#SBATCH --array=0-7 ": "#SBATCH --array=0-2 ",
        "#SBATCH --gres=gpu:4\n": "",
        "postgresql://towerlab@db.example.org/towerlab": postgres_url,
        "--device cuda": "--device cpu --devices 1",
    })
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "TOWERLAB_LEASE_SECONDS": "5"}
    job = submit(slurm_cluster, tmp_path, text, env)
    logs = ArrayLogs(tmp_path, "towerlab-worker-JOB_TASK.log", job, "012")
    (tmp_path / "space.toml").write_text(SPACE)
    search = start_towerlab(*LONG_SEARCH, "--space", str(tmp_path / "space.toml"), "--store", postgres_url,
                            "--out", str(tmp_path / "search"), log=tmp_path / "search.log")
    with reaped(search):
        held: dict[str, str] = {}
        wait_for(lambda: held.update(training(postgres_url, set())) or held, timeout=180,
                 what="an array task's worker to train")
        cancelled, worker = next(iter(held.items()))
        slurm_cluster.run("scancel", f"{job}_{cancelled}")
        wait_for(lambda: held.update(training(postgres_url, {cancelled})) or set(held) - {cancelled}, timeout=180,
                 what="another array task's worker to train")
        requeued = next(task for task in held if task != cancelled)
        # the search job (and its own worker, with the task it holds) stands still until the requeued task is
        # back: Slurm takes seconds to start it again, and the others once ended the search before that
        os.killpg(search.pid, signal.SIGSTOP)
        try:
            slurm_cluster.run("scontrol", "requeue", f"{job}_{requeued}")
            wait_for(lambda: slurm_cluster.run("squeue", "-h", "-j", f"{job}_{requeued}", "-o", "%T").stdout.strip()
                     in ("PENDING", "RUNNING"), timeout=60, what="the requeued task to be queued again")
            slurm_cluster.run("scontrol", "update", f"JobId={job}_{requeued}", "StartTime=now")
            wait_for(lambda: logs.said(requeued, "towerlab search worker: 1 worker(s)") == 2, timeout=120,
                     what="the requeued task to start again")
        finally:
            os.killpg(search.pid, signal.SIGCONT)
        assert search.wait(timeout=600) == 0, (tmp_path / "search.log").read_text()
    again = logs.files[requeued].read_text().rpartition("towerlab search worker: 1 worker(s)")[2]
    assert again.startswith(" on cpu joining its 1 unfinished search(es)"), logs.files[requeued].read_text()
    assert decisive(postgres_url) == decisive(reference / "search" / "search.db")
    assert cancelled not in running(slurm_cluster, job)
    slurm_cluster.run("scancel", job)
    wait_for(lambda: not running(slurm_cluster, job), timeout=60, what="the array to end")
    # the cancelled worker handed its candidate back and left saying what it did; every one that joined
    # trained with the search's data and software, as the rows record
    assert logs.said(cancelled, "leaving after") == 1, logs.files[cancelled].read_text()
    with Store(postgres_url, create=False) as store:
        rows = store.records.evaluations()
        task = [t for t in store.queue.tasks(1) if t.state == "done" and t.result and t.result.get("worker") != worker]
    assert task and len({(e.provenance["data"], e.provenance["code"]) for e in rows}) == 1
    assert "Traceback" not in logs.text()


@pytest.mark.slow
def test_the_docs_cpu_node_script_finds_towerlab_its_data_and_password_as_written(
        tmp_path, postgres_server, slurm_cluster, monkeypatch):
    """Issue 65, defect 18: the recipe worked on GPU nodes only, and said nowhere where a worker finds towerlab,
    the data, the password, or how many CPU workers a task runs. The CPU-node script of
    docs/distributed-search.md, its paths and sizes made this machine's, is submitted with an environment
    that holds none of those (no venv on PATH, no $TOWERLAB_DATA, no password: a home with a .pgpass): its
    tasks' workers (2 each, --devices from the task's CPUs) join a search of an MNIST of files on a store
    whose user has a password, and train it to its end."""
    password = "pa55 word"
    url = postgres_server.password_database(password)
    where = urlsplit(url)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".pgpass").write_text(f"{where.hostname}:{where.port}:{where.path[1:]}:{where.username}:{password}\n")
    (home / ".pgpass").chmod(0o600)
    data = mnist_files(tmp_path / "data")
    venv = Path(sys.prefix)
    text = script("distributed-search.md", "#SBATCH --job-name=towerlab-cpu-workers", {
        "#SBATCH --array=0-15 ": "#SBATCH --array=0-1 ",
        "#SBATCH --cpus-per-task=32 ": "#SBATCH --cpus-per-task=2 ",
        "/shared/towerlab/venv": str(venv),
        "/shared/towerlab/data": str(data),
        "postgresql://towerlab@db.example.org/towerlab": url,
    })
    assert (venv / "bin" / "activate").is_file(), "the tests run in a virtual environment"
    hidden = ("VIRTUAL_ENV", "TOWERLAB_DATA", "TOWERLAB_STORE", "PGPASSWORD", "PGPASSFILE", "PYTHONPATH")
    env = {**{k: v for k, v in os.environ.items() if k not in hidden}, "HOME": str(home), "TOWERLAB_LEASE_SECONDS": "5",
           "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(str(venv)))}
    job = submit(slurm_cluster, tmp_path, text, env)
    logs = ArrayLogs(tmp_path, "towerlab-cpu-worker-JOB_TASK.log", job, "01")
    (tmp_path / "space.toml").write_text(SPACE)
    monkeypatch.setenv("TOWERLAB_DATA", str(data))
    monkeypatch.setenv("PGPASSWORD", password)
    search = start_towerlab("search", "run", "--sampler", "random", "--dataset", "mnist", "--val-size", "1000",
                            "--max-epochs", "2", "--threads", "1", "--no-progress", "--population", "4",
                            "--generations", "10", "--seed", "5", "--top", "2", "--device", "cpu", "--devices", "1",
                            "--space", str(tmp_path / "space.toml"), "--store", url, "--out", str(tmp_path / "search"),
                            log=tmp_path / "search.log")
    with reaped(search):
        assert search.wait(timeout=600) == 0, (tmp_path / "search.log").read_text()
    slurm_cluster.run("scancel", job)
    wait_for(lambda: not running(slurm_cluster, job), timeout=60, what="the array to end")
    assert all(logs.said(task, "towerlab search worker: 2 worker(s) on cpu joining") for task in logs.files)
    told = logs.text()
    assert told.count(": search 1, generation ") >= 1 and "not joining" not in told and "Traceback" not in told, told
    with Store(url, create=False) as store:
        rows = store.records.evaluations()
    assert len({(e.provenance["data"], e.provenance["code"]) for e in rows}) == 1


@pytest.mark.slow
def test_the_docs_torchrun_script_trains_over_slurm(tmp_path, slurm_cluster):
    """docs/training.md's Slurm script (one torchrun agent per node, the first node the rendezvous) on the
    one node here, two CPU processes training LeNet-5 on synthetic data for an epoch: it had never run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = script("training.md", "#SBATCH --nodes", {
        "#SBATCH --nodes=2\n": "#SBATCH --nodes=1\n",
        "#SBATCH --gpus-per-node=4\n": "",
        "#SBATCH --cpus-per-task=32\n": "#SBATCH --cpus-per-task=2\n",
        "--nproc-per-node 4": "--nproc-per-node 2",
        "$head:29500": f"$head:{port}",
        "--model cifarnet --dataset cifar10 --epochs 20": "--model lenet5 --dataset synthetic --synthetic-train 2000 "
                                                          "--val-size 500 --epochs 1 --no-progress",
    })
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    job = submit(slurm_cluster, tmp_path, text, env)
    deadline = time.monotonic() + 300
    while "JobState=COMPLETED" not in (state := slurm_cluster.run("scontrol", "show", "job", job).stdout):
        assert "JobState=FAILED" not in state and time.monotonic() < deadline, (
            state, "".join(p.read_text() for p in tmp_path.glob("slurm-*.out")))
        time.sleep(0.5)
    summary = json.loads((tmp_path / "runs" / f"cifar-{job}" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 1 and summary["test_accuracy"] is not None
