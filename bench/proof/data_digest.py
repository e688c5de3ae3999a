"""What proving a dataset's content costs (towerlab.data.digest: the digest of the decoded arrays, computed from
them each time), which hash it is made with, and what a worker's start pays for it before and after issue 65:

- hashes: each candidate over the decoded arrays of MNIST, CIFAR-10 and a generated image folder of several
  GB (its cache's arrays): SHA-256, BLAKE2b, SHA-1 and MD5 on one thread, xxHash's XXH3-128 where the
  package is installed (not cryptographic: measured for scale; towerlab does not depend on it), and
  towerlab's digest (SHA-256 of 16 MiB pieces on every core); GB/s, the median of --rounds;
- the data step of a worker's start (a fresh interpreter loads the dataset and takes its digest, as a search
  worker does before its first claim), MNIST and CIFAR-10: --before SRC (an older towerlab's src folder,
  e.g. main's, whose digest a cache of the files' paths, sizes and times answers: its cold side computes it
  and writes the cache, its warm side reads it back) against this checkout's; sides alternate in a round;
- the image folder, --images BMP files of 256x256 pixels in 3 class folders written under a temporary
  folder (never in the repository), decoded at 256x256: its first load (pass 1, the decode, the check of
  the entry written) and its later loads (the listing, pass 1 reading and hashing every file, the entry
  checked in full: where the older towerlab recognised the folder by its files' stats alone), and the
  digest of the loaded data, before and after.

    git archive da77368 src | tar -x -C /tmp/main        # the code before, for --before
    nice -n 10 python bench/proof/data_digest.py --before /tmp/main/src --note "..."   # ~15 min on 2 busy cores

Writes results/proof/data-digest-proof-<date>.json ({"figures": [{"id", "value", "unit", "detail"}]}).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import REPO, RESULTS, script_command, write_record

PROBE = """
import json, sys, time
started = time.perf_counter()
from towerlab.data.digest import content_digest
from towerlab.data.folders import FolderOptions
from towerlab.data.load import load_dataset
name, data_dir, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
folder = {"folder": FolderOptions(image_size=(size, size))} if size else {}
imported = time.perf_counter()
data = load_dataset(name, data_dir, 5000 if not size else 300, download=False, log=lambda line: None, **folder)
loaded = time.perf_counter()
digest = content_digest(data)
print(json.dumps({"import_seconds": imported - started, "load_seconds": loaded - imported,
                  "digest_seconds": time.perf_counter() - loaded, "digest": digest}))
"""
SIDE = 256  # the generated images' side, and the size they are decoded at
CLASSES = ("a", "b", "c")


def _env(src: Path, cache: Path) -> dict:
    return {**measure.child_env(), "XDG_CACHE_HOME": str(cache),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}


def probe(src: Path, cache: Path, name: str, data_dir: str, size: int = 0) -> dict:
    """A fresh interpreter with towerlab from `src`: load `name`, take its digest; its seconds."""
    with machine.CpuWatch() as watch:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", PROBE, name, data_dir, str(size)], capture_output=True, text=True,
                              env=_env(src, cache), timeout=3600)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"data_digest.py: the probe failed ({src}): {done.stderr[-600:]}")
    return {**json.loads(done.stdout), "wall_seconds": wall, "foreign_cores": watch.use.as_dict()["foreign_cores"]}


def hash_speeds(arrays: list[np.ndarray], digest: Callable[[], str], rounds: int) -> dict:
    """GB/s of each candidate over `arrays` (one thread each, but towerlab's own), the median of `rounds`."""
    nbytes = sum(a.nbytes for a in arrays)
    candidates: dict[str, Callable[[], object]] = {
        name: (lambda name=name: [hashlib.new(name, a.reshape(-1).view(np.uint8).data).digest() for a in arrays])
        for name in ("sha256", "blake2b", "sha1", "md5")}
    try:
        import xxhash

        candidates["xxh3_128"] = lambda: [xxhash.xxh3_128(a.reshape(-1).view(np.uint8).data).digest() for a in arrays]
    except ImportError:
        pass
    candidates["towerlab (sha256 pieces, every core)"] = digest
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, run in candidates.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return {"bytes": nbytes, "gb_per_second": {n: nbytes / 1e9 / statistics.median(s) for n, s in seconds.items()},
            "seconds": seconds}


def write_folder(root: Path, images: int) -> int:
    """`images` BMP files of SIDE x SIDE noise in CLASSES' folders under `root`; their bytes."""
    rng = np.random.default_rng(0)
    from PIL import Image

    pool = rng.integers(0, 256, (64, SIDE, SIDE, 3), dtype=np.uint8)
    total = 0
    for k in range(images):
        folder = root / CLASSES[k % len(CLASSES)]
        folder.mkdir(parents=True, exist_ok=True)
        image = np.roll(pool[k % 64], k // 64, axis=1)  # each file other bytes
        image[0, 0] = (k % 251, k // 251 % 251, len(CLASSES))
        path = folder / f"{k:06d}.bmp"
        Image.fromarray(image).save(path)
        total += path.stat().st_size
    return total


def sides_alternating(sides: dict[str, Callable[[], dict]], rounds: int) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        machine.wait_for_quiet(timeout=10.0)
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append({"round": r, **sides[name]()})
    return samples


def medians(samples: dict[str, list[dict]], key: str) -> dict[str, float]:
    return {side: statistics.median(s[key] for s in runs) for side, runs in samples.items()}


def figure(fid: str, value: Optional[float], unit: str, detail: dict) -> dict:
    return {"id": fid, "value": value, "unit": unit, "detail": detail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="an older towerlab's src folder, measured beside this checkout's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=15_000, help="files of the generated image folder")
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out-dir", default=str(RESULTS / "proof"))
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    from towerlab.data.digest import arrays_digest, content_digest
    from towerlab.data.folders import FolderOptions
    from towerlab.data.load import load_dataset

    after = REPO / "src"
    figures: list[dict] = []
    names = [n for n, f in (("mnist", "mnist.npz"), ("cifar10", "cifar10.npz")) if (Path(args.data_dir) / f).exists()]
    with tempfile.TemporaryDirectory(prefix="towerlab-digest-") as scratch:
        scratch_dir = Path(scratch)
        for name in names:
            data = load_dataset(name, args.data_dir, 5000, download=False)
            arrays = [t.numpy() for t in (data.x_train, data.x_val, data.x_test, data.y_train, data.y_val, data.y_test)]
            speeds = hash_speeds(arrays, lambda data=data: content_digest(data), args.rounds)
            figures.append(figure(f"hash_{name}", speeds["gb_per_second"]["towerlab (sha256 pieces, every core)"], "GB/s",
                                  speeds))
            print(f"{name}: {speeds['bytes'] / 1e6:.0f} MB; GB/s " +
                  ", ".join(f"{k} {v:.2f}" for k, v in speeds["gb_per_second"].items()), flush=True)
            sides: dict[str, Callable[[], dict]] = {"after": lambda name=name: probe(after, scratch_dir / "a", name,
                                                                                     args.data_dir)}
            if args.before:
                before_cache = scratch_dir / "before"

                def cold(name: str = name) -> dict:
                    shutil.rmtree(before_cache, ignore_errors=True)
                    return probe(Path(args.before), before_cache, name, args.data_dir)

                sides["before_cold_cache"] = cold
                sides["before_warm_cache"] = lambda name=name: (probe(Path(args.before), before_cache, name,
                                                                      args.data_dir))
            samples = sides_alternating(sides, args.rounds)
            digest_ms = {k: v * 1000 for k, v in medians(samples, "digest_seconds").items()}
            figures.append(figure(f"worker_data_step_{name}", medians(samples, "load_seconds")["after"]
                                  + digest_ms["after"] / 1000, "s",
                                  {"what": "a fresh interpreter: load the dataset, then its digest (a worker's data "
                                           "step before its first claim)", "digest_ms_median": digest_ms,
                                   "load_seconds_median": medians(samples, "load_seconds"),
                                   "import_seconds_median": medians(samples, "import_seconds"), "samples": samples}))
            print(f"{name}: digest {digest_ms} ms", flush=True)
        folder = scratch_dir / "images"
        started = time.perf_counter()
        file_bytes = write_folder(folder, args.images)
        print(f"wrote {args.images:,} files, {file_bytes / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s",
              flush=True)
        folder_sides = {"after": after, **({"before": Path(args.before)} if args.before else {})}
        first = {side: probe(src, scratch_dir / f"folder-{side}", f"{folder}/", str(scratch_dir / f"data-{side}"), SIDE)
                 for side, src in folder_sides.items()}
        again = sides_alternating({side: (lambda side=side, src=src: probe(src, scratch_dir / f"folder-{side}",
                                                                           f"{folder}/", str(scratch_dir / f"data-{side}"),
                                                                           SIDE))
                                   for side, src in folder_sides.items()}, max(1, args.rounds // 2))
        loaded = load_dataset(f"{folder}/", scratch_dir / "data-after", 300, download=False, log=lambda line: None,
                              folder=FolderOptions(image_size=(SIDE, SIDE)))
        x = np.load(Path(loaded.source["cache"]) / "x.npy", mmap_mode="r")
        y = np.load(Path(loaded.source["cache"]) / "y.npy")
        speeds = hash_speeds([x, y], lambda: arrays_digest({}, [[x], [y]]), max(1, args.rounds // 2))
        figures.append(figure("hash_image_folder", speeds["gb_per_second"]["towerlab (sha256 pieces, every core)"],
                              "GB/s", {**speeds, "files": args.images, "file_bytes": file_bytes}))
        figures.append(figure("image_folder_load", medians(again, "load_seconds")["after"], "s",
                              {"what": f"{args.images:,} BMP files of {SIDE}x{SIDE} ({file_bytes / 2**30:.2f} GiB), their "
                                       f"cache {x.nbytes / 2**30:.2f} GiB: a load with the entry there, in a fresh "
                                       "interpreter", "first_load": first, "load_seconds_median": medians(again, "load_seconds"),
                                       "digest_seconds_median": medians(again, "digest_seconds"), "samples": again}))
        print(f"image folder: first {json.dumps({k: round(v['load_seconds'], 1) for k, v in first.items()})} s; "
              f"again {medians(again, 'load_seconds')} s; digest {medians(again, 'digest_seconds')} s; GB/s " +
              ", ".join(f"{k} {v:.2f}" for k, v in speeds["gb_per_second"].items()), flush=True)
    return write_rounds(args, __file__, "data-digest-proof", figures, argv)


def write_rounds(args: argparse.Namespace, script: str, name: str, figures: list[dict], argv: Optional[list[str]],
                 ) -> int:
    """The record of a script of sides measured in rounds (`args`: its --note, --rounds, --out-dir), as
    bench/results/proof/`name`-<date>.json (or --out-dir); its path printed."""
    record = {"date": measure.now(), "machine": machine.describe(), "note": args.note,
              "command": script_command(script, argv),
              "rounds": args.rounds, "figures": figures}
    print(write_record(args.out_dir, f"{name}-{time.strftime('%Y-%m-%d')}.json", record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
