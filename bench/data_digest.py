"""What checking a dataset's content adds to a search worker's start (towerlab.data.digest), with the cache of
digests empty (the SHA-256 of the decoded arrays is computed) or holding the files' entry (read back by
path, size and modification time); the two sides alternate within a round, the median of the rounds:

- the data step: a fresh interpreter loads a dataset as a worker does and takes its digest;
- a worker's whole start: `towerlab search worker` joining an unfinished MNIST search (one CPU), from the
  command to its decision, with a copy of MNIST whose one training label differs, so that it loads the
  data, takes their digest, is refused and exits (status 2) without training.

    python bench/data_digest.py               # 5 rounds, MNIST and CIFAR-10 from ../shared/data (~3 min)

Writes results/data-digest-<date>.json: per dataset, the seconds of the load and of the digest on each
side, and what the digest adds to the load; the worker's seconds on each side.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import machine
import measure

PROBE = """
import json, sys, time
from towerlab.data.digest import content_digest
from towerlab.data.load import load_dataset
started = time.perf_counter()
data = load_dataset(sys.argv[1], val_size=5000, download=False)
loaded = time.perf_counter()
digest = content_digest(data)
print(json.dumps({"load_seconds": loaded - started, "digest_seconds": time.perf_counter() - loaded, "digest": digest}))
"""


def sample(name: str, data_dir: str, cache: Path, warm: bool) -> dict:
    """One fresh interpreter: load `name`, take its digest, with the cache of digests warm or empty."""
    digests = cache / "towerlab" / "content-digests.json"
    if not warm:
        digests.unlink(missing_ok=True)
    env = {**measure._env(), "TOWERLAB_DATA": data_dir, "XDG_CACHE_HOME": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(measure.REPO / "src"), os.environ.get("PYTHONPATH")]))}
    with machine.CpuWatch() as watch:
        done = subprocess.run([sys.executable, "-c", PROBE, name], capture_output=True, text=True, env=env,
                              timeout=600, check=True)
    return {**json.loads(done.stdout), "foreign_cores": watch.use.as_dict()["foreign_cores"]}


def _env(cache: Path, data_dir: str) -> dict:
    return {**measure._env(), "TOWERLAB_DATA": data_dir, "XDG_CACHE_HOME": str(cache),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(measure.REPO / "src"), os.environ.get("PYTHONPATH")]))}


def unfinished_search(folder: Path, data_dir: str, cache: Path) -> Path:
    """A random search of MLPs on MNIST stopped after its first evaluation: a worker has a search to check."""
    out = folder / "search"
    job = subprocess.Popen([sys.executable, "-m", "towerlab", "search", "run", "--sampler", "random", "--dataset",
                            "mnist", "--max-epochs", "1", "--population", "4", "--generations", "4", "--device", "cpu",
                            "--devices", "1", "--threads", "1", "--no-progress", "--out", str(out)],
                           env=_env(cache, data_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(out / "search.db") as db:
                if db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0]:
                    break
        except sqlite3.Error:  # not made yet
            pass
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    return out


def worker_start(out: Path, other_data: str, cache: Path, warm: bool, good_data: str) -> dict:
    """`towerlab search worker OUT` with MNIST of one other label: its seconds from the command to its exit."""
    digests = cache / "towerlab" / "content-digests.json"
    digests.unlink(missing_ok=True)
    if warm:  # the entry of this copy's files, as a worker that saw them before left it
        sample("mnist", other_data, cache, warm=False)
    with machine.CpuWatch() as watch:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "towerlab", "search", "worker", str(out), "--device", "cpu",
                               "--devices", "1"], capture_output=True, text=True, env=_env(cache, other_data),
                              timeout=600)
        seconds = time.perf_counter() - started
    if done.returncode != 2 or "its data differ" not in done.stderr:
        raise SystemExit(f"data_digest.py: the worker was not refused for its data: {done.stderr[-400:]}")
    return {"seconds": seconds, "foreign_cores": watch.use.as_dict()["foreign_cores"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out-dir", default=str(measure.BENCH / "results"))
    args = parser.parse_args(argv)
    names = [n for n, f in (("mnist", "mnist.npz"), ("cifar10", "cifar10.npz")) if (Path(args.data_dir) / f).exists()]
    if not names:
        raise SystemExit(f"data_digest.py: neither mnist.npz nor cifar10.npz in {args.data_dir}")
    figures = []
    with tempfile.TemporaryDirectory(prefix="towerlab-digest-") as cache:
        for name in names:
            sample(name, args.data_dir, Path(cache), warm=False)  # the page cache holds the file for every side
            samples: dict[str, list[dict]] = {"empty_cache": [], "warm_cache": []}
            for r in range(args.rounds):
                machine.wait_for_quiet(timeout=10.0)
                for side in (("empty_cache", "warm_cache") if r % 2 == 0 else ("warm_cache", "empty_cache")):
                    if side == "warm_cache":
                        sample(name, args.data_dir, Path(cache), warm=False)  # the entry it reads back
                    samples[side].append({"round": r, **sample(name, args.data_dir, Path(cache),
                                                               warm=side == "warm_cache")})
            digests = {s["digest"] for runs in samples.values() for s in runs}
            assert len(digests) == 1, f"{name}: the cache gave another digest than the arrays: {digests}"
            medians = {side: {key: statistics.median(s[key] for s in runs)
                              for key in ("load_seconds", "digest_seconds")} for side, runs in samples.items()}
            label = {"mnist": "MNIST", "cifar10": "CIFAR-10"}[name]
            figures.append({"id": f"digest_seconds_{name}",
                            "title": f"{label}'s content digest (its decoded arrays hashed), median seconds with an "
                                     "empty digest cache",
                            "value": medians["empty_cache"]["digest_seconds"], "unit": "s",
                            "detail": {"median": medians,
                                       "digest_over_load": {side: m["digest_seconds"] / m["load_seconds"]
                                                            for side, m in medians.items()},
                                       "samples": samples}})
            print(f"{name}: load {medians['empty_cache']['load_seconds']:.3f} s; digest "
                  f"{medians['empty_cache']['digest_seconds'] * 1000:.1f} ms with an empty cache, "
                  f"{medians['warm_cache']['digest_seconds'] * 1000:.2f} ms from the cache", flush=True)
        if "mnist" in names:
            folder = Path(cache) / "worker"
            other = folder / "other"
            other.mkdir(parents=True)
            with np.load(Path(args.data_dir) / "mnist.npz") as arrays:
                changed = dict(arrays)
            changed["y_train"][17] = (changed["y_train"][17] + 1) % 10
            np.savez(other / "mnist.npz", **changed)
            out = unfinished_search(folder, args.data_dir, Path(cache))
            runs: dict[str, list[dict]] = {"empty_cache": [], "warm_cache": []}
            for r in range(args.rounds):
                machine.wait_for_quiet(timeout=10.0)
                for side in (("empty_cache", "warm_cache") if r % 2 == 0 else ("warm_cache", "empty_cache")):
                    runs[side].append({"round": r, **worker_start(out, str(other), Path(cache),
                                                                  side == "warm_cache", args.data_dir)})
            starts = {side: statistics.median(s["seconds"] for s in samples) for side, samples in runs.items()}
            figures.append({"id": "worker_start_mnist",
                            "title": "a worker's start to its refusal for other data (MNIST), median seconds with an "
                                     "empty digest cache",
                            "value": starts["empty_cache"], "unit": "s",
                            "detail": {"median_seconds": starts, "samples": runs}})
            print(f"a worker's start to its refusal (MNIST): {starts['empty_cache']:.2f} s with an empty cache, "
                  f"{starts['warm_cache']:.2f} s with a warm one", flush=True)
    record = {"date": measure.now(), "machine": machine.describe(),
              "command": ["python", "bench/data_digest.py", *(argv if argv is not None else sys.argv[1:])],
              "rounds": args.rounds, "figures": figures}
    print(machine.write_record(args.out_dir, f"data-digest-{time.strftime('%Y-%m-%d')}.json", record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
