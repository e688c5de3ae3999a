"""What a search worker's start costs, from its command's start to its first claim, before and after issue 65's
proof of what runs (towerlab.proof.package: towerlab's modules imported through PackageLoader, the installed
package digested whole; a model file's proof; the data's digest computed from the arrays each time):

- worker_start_mnist: `towerlab search worker DIR --device cpu --devices 1` joining an unfinished search on
  MNIST ($TOWERLAB_DATA's mnist.npz) in a fresh interpreter, from the command's start to its first claim (the
  task's `claimed` time in the store, on the kernel's clock: the launcher's start, its worker's, torch,
  the store, the admission with its digests, the data); --before SRC (an older towerlab's src folder, e.g.
  da77368's) against this checkout's src, each joining a copy of a search its own code made (another
  towerlab's code digest would refuse it); the sides alternate in a round. The older side's digest of the
  data comes from its cache of the files' paths, sizes and times, warm after the first (unmeasured) round.
- package_proof: what the proof adds inside a fresh interpreter of this checkout: importing what a worker
  imports (towerlab.jobs.search.workers, torch with it) through PackageLoader, its checked .pyc files written,
  against Python's own loader on the same files with pip's time-stamped .pyc files; the package's digest
  (`code_digest`); and, on a read-only copy holding pip's .pyc files only, PackageLoader compiling each module
  at each start.

    git archive da77368 src | tar -x -C /tmp/old           # the code before, for --before
    nice -n 10 python bench/proof/worker_start.py --before /tmp/old/src --note "..."   # ~5 min on 2 busy cores

Writes results/proof/worker-start-<date>.json ({"figures": [{"id", "value", "unit", "detail"}]}).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure, worker_times
from bench.common.record import REPO, RESULTS
from bench.proof.data_digest import medians, sides_alternating, write_rounds

SPACE = '{"model": "mlp", "genes": {"neurons": [32, 64], "layers": [1, 2]}}'
SEARCH = ["search", "run", "--sampler", "random", "--dataset", "mnist", "--val-size", "5000", "--max-epochs", "1",
          "--population", "4", "--generations", "1", "--top", "1", "--remeasure", "0", "--seed", "3", "--threads", "1",
          "--device", "cpu", "--devices", "1", "--no-progress", "--space", SPACE]

# What a worker imports, timed in a fresh interpreter; then the package's digest (PackageLoader's sides).
IMPORTS = """
import json, sys, time
started = time.perf_counter()
import towerlab
if sys.argv[1] == "python":  # Python's own loader for the rest of the package
    from towerlab.proof.package import _PackageFinder
    sys.meta_path.remove(_PackageFinder)
import towerlab.jobs.search.workers
imported = time.perf_counter()
if sys.argv[1] != "python":
    from towerlab.objective.admission import code_digest
    code_digest()
print(json.dumps({"import_seconds": imported - started, "digest_seconds": time.perf_counter() - imported,
                  "file": towerlab.__file__}))
"""


def env_for(src: Path, data_dir: str, cache: Path) -> dict:
    """A side's environment: its towerlab first on the path, the data, its own cache folder."""
    hidden = ("TOWERLAB_STORE", "PYTHONDONTWRITEBYTECODE", worker_times.FOLDER, worker_times.CLOCK)
    return {**{k: v for k, v in measure.child_env().items() if k not in hidden}, "PYTHONPATH": str(src),
            "TOWERLAB_DATA": data_dir, "XDG_CACHE_HOME": str(cache)}


def claims(store: Path) -> list[tuple]:
    try:
        with sqlite3.connect(store) as db:
            return db.execute("SELECT worker, claimed FROM tasks WHERE claimed IS NOT NULL").fetchall()
    except sqlite3.OperationalError:  # its tables not made yet
        return []


def made_search(src: Path, folder: Path, env: dict) -> Path:
    """A search on MNIST that `src`'s towerlab made and that nothing works on: its job killed (SIGKILL) as
    soon as its first generation is on the queue (a task its worker claimed meanwhile is a dead worker's,
    which the next worker of this machine puts back)."""
    out = folder / "search"
    job = subprocess.Popen([sys.executable, "-m", "towerlab", *SEARCH, "--out", str(out)], env=env, cwd=folder,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if (out / "search.db").exists():
                with sqlite3.connect(out / "search.db") as db:
                    try:
                        if db.execute("SELECT count(*) FROM tasks").fetchone()[0]:
                            break
                    except sqlite3.OperationalError:
                        pass
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker_start.py: the search of {src} ended or hung before its queue was filled")
            time.sleep(0.01)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    return out


def worker_start(template: Path, round_folder: Path, env: dict) -> dict:
    """A worker joining a copy of `template`: seconds from its command's start to its first claim, and the
    worker's own breakdown (its process's start and data: bench/common/worker_times.py) where it writes one."""
    shutil.rmtree(round_folder, ignore_errors=True)
    shutil.copytree(template, round_folder)
    times = round_folder / "times"
    with machine.CpuWatch() as watch:
        started = time.time()
        done = subprocess.run([sys.executable, "-m", "towerlab", "search", "worker", str(round_folder), "--device", "cpu",
                               "--devices", "1"], capture_output=True, text=True, timeout=900, cwd=round_folder,
                              env={**env, **worker_times.environment(times, env["PYTHONPATH"])})
    if done.returncode != 0:
        raise SystemExit(f"worker_start.py: the worker exited {done.returncode}: {done.stderr.strip()[-600:]}")
    first = min(claimed for _, claimed in claims(round_folder / "search.db") if claimed > started)
    written = [json.loads(p.read_text()) for p in times.glob("*.json")]
    return {"start_to_first_claim": first - started, "foreign_cores": watch.use.as_dict()["foreign_cores"],
            "worker_times": written[0]["seconds"] if written else None}


def imports(src_copy: Path, loader: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", IMPORTS, loader], capture_output=True, text=True, timeout=300,
                          cwd=src_copy, env={**env, "PYTHONPATH": str(src_copy)})
    if done.returncode != 0:
        raise SystemExit(f"worker_start.py: the import probe failed: {done.stderr.strip()[-600:]}")
    found = json.loads(done.stdout)
    assert found["file"].startswith(str(src_copy)), found
    return found


def package_copy(folder: Path, read_only: bool = False) -> Path:
    """This checkout's package copied into `folder`, with pip's time-stamped .pyc files."""
    shutil.copytree(REPO / "src" / "towerlab", folder / "towerlab", ignore=shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(folder / "towerlab", quiet=1)
    if read_only:
        for path in folder.rglob("*"):
            path.chmod(0o555 if path.is_dir() else 0o444)
        folder.chmod(0o555)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="an older towerlab's src folder, measured beside this checkout's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out-dir", default=str(RESULTS / "proof"))
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if not (Path(args.data_dir) / "mnist.npz").is_file():
        raise SystemExit(f"worker_start.py: no mnist.npz in {args.data_dir} (--data-dir)")
    figures: list[dict] = []
    sources = {"after": REPO / "src", **({"before": Path(args.before).resolve()} if args.before else {})}
    with tempfile.TemporaryDirectory(prefix="towerlab-worker-start-") as scratch:
        scratch_dir = Path(scratch)
        envs = {side: env_for(src, args.data_dir, scratch_dir / f"cache-{side}") for side, src in sources.items()}
        templates = {}
        for side, src in sources.items():
            (scratch_dir / side).mkdir()
            templates[side] = made_search(src, scratch_dir / side, envs[side])
        for side in sources:  # unmeasured: the page cache warm, the .pyc files written, the older cache filled
            worker_start(templates[side], scratch_dir / f"{side}-round", envs[side])
        samples = sides_alternating({side: (lambda side=side: worker_start(templates[side], scratch_dir / f"{side}-round",
                                                                    envs[side])) for side in sources}, args.rounds)
        found = medians(samples, "start_to_first_claim")
        figures.append({"id": "worker_start_mnist", "value": found["after"], "unit": "s", "detail": {
            "what": "`towerlab search worker DIR --device cpu --devices 1` joining an unfinished search on MNIST: from "
                    "the command's start to its first claim (median of the rounds)",
            "median_seconds": found,
            **({"after_minus_before_seconds": found["after"] - found["before"],
                "after_over_before": found["after"] / found["before"]} if "before" in found else {}),
            "samples": samples}})
        print(f"worker start to first claim (median): {json.dumps({k: round(v, 3) for k, v in found.items()})}",
              flush=True)
        env = envs["after"]
        plain = package_copy(scratch_dir / "plain")
        proven = package_copy(scratch_dir / "proven")
        imports(proven, "proof", env)  # its checked .pyc files written once, as a worker's first start writes them
        read_only = package_copy(scratch_dir / "read-only", read_only=True)
        probes = sides_alternating({"python_loader": lambda: imports(plain, "python", env),
                              "package_loader": lambda: imports(proven, "proof", env),
                              "package_loader_read_only": lambda: imports(read_only, "proof", env)}, args.rounds)
        for path in read_only.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        read_only.chmod(0o755)
        imported = medians(probes, "import_seconds")
        digested = medians(probes, "digest_seconds")
        figures.append({"id": "package_proof", "value": imported["package_loader"] + digested["package_loader"]
                        - imported["python_loader"], "unit": "s", "detail": {
            "what": "a fresh interpreter: import towerlab.jobs.search.workers (torch with it), then code_digest(); the "
                    "value is what the proof adds to Python's own loader (imports and the digest)",
            "import_seconds_median": imported, "digest_seconds_median": digested, "samples": probes}})
        print(f"imports (median s): {json.dumps({k: round(v, 3) for k, v in imported.items()})}; digest (median s): "
              f"{json.dumps({k: round(v, 4) for k, v in digested.items()})}", flush=True)
    return write_rounds(args, __file__, "worker-start", figures, argv)


if __name__ == "__main__":
    sys.exit(main())
