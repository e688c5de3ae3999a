"""Image folders (--dataset PATH/): how fast a folder decodes into its cache and reopens from it, and
the resident memory of a training over a cache larger than it.

    python bench/speed/image_folder.py cifar    # CIFAR-10's 60,000 images as PNG files: decode, reopen
    python bench/speed/image_folder.py large    # a folder whose cache is several GB: peak RSS of a training

`cifar` writes cifar10.npz's 60,000 images as PNG files (train/<class>/NNNNN.png, test/<class>/...)
under --folder (default: a folder in the system's temporary folder; never in the repository), then,
each round in fresh processes and a fresh data folder: the first `load_dataset` (listing, pass 1 reading
and hashing every file, pass 2 decoding every image into the cache, the channel statistics), then
--reopens more (the listing, pass 1 again, the memory map and its check: the entry's arrays read
and their digest compared, the cached statistics; records before 2026-11-28 recognised a folder by its
files' stats alone).
The files are in the page cache throughout (they were just written), for both.

`large` writes --images JPEG files of --side x --side pixels in 3 class folders (--held of them in
test/, as many in val/, the rest in train/: an evaluation batch of 1,024 such images is 0.8 GB of
floats, which would outweigh a training batch), decodes them once
at that size (--image-size), then trains an MLP (1 layer of 8 neurons: little computation per byte
read) for one epoch over the cache in a fresh process, twice: as towerlab does (each
batch's pages given back to the system) and with that turned off; each reports its peak RSS
(ru_maxrss), the cache's size beside it.

Each writes bench/results/speed/image-folder-{cifar,large}-<date>.json. The machine is shared: run it under
`nice` and say so (--note).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.machine import CpuWatch, describe, wait_for_quiet
from bench.common.measure import default_data_dir
from bench.common.record import RESULTS, script_command, write_record

CIFAR_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_ARRAYS: dict = {}  # the forked writers' copy of the arrays they write
QUIET_WAIT = 20.0  # seconds a sample waits for the machine to quieten before it runs anyway


def _write_png(job: tuple[str, int, str]) -> None:
    from PIL import Image

    split, index, path = job
    Image.fromarray(_ARRAYS[f"x_{split}"][index]).save(path)


def build_cifar(data_dir: str, folder: Path) -> Path:
    """cifar10.npz's images as PNG files, named by their index, in their classes' folders."""
    from multiprocessing import get_context

    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    with np.load(Path(data_dir) / "cifar10.npz") as raw:
        _ARRAYS.update({key: raw[key] for key in raw.files})
    jobs = []
    for split in ("train", "test"):
        labels = _ARRAYS[f"y_{split}"].reshape(-1)
        for name in CIFAR_NAMES:
            (folder / split / name).mkdir(parents=True)
        jobs += [(split, i, str(folder / split / CIFAR_NAMES[int(y)] / f"{i:05d}.png")) for i, y in enumerate(labels)]
    with get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(_write_png, jobs, chunksize=500)
    (folder / "done").write_text("")
    return folder


def _write_jpegs(job: tuple[int, int, int, str]) -> None:
    from PIL import Image

    index, side, label, path = job
    rng = np.random.default_rng(index)
    tint = np.array([(200, 60, 60), (60, 200, 60), (60, 60, 200)][label])
    small = np.clip(rng.normal(tint, 50, (16, 16, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(small).resize((side, side), Image.Resampling.BILINEAR).save(path, quality=90)


def build_large(folder: Path, images: int, side: int, held: int) -> Path:
    """`images` smooth side x side JPEGs (a colour per class, noise) in 3 class folders: `held` of
    them in test/, as many in val/, the rest in train/."""
    from multiprocessing import get_context

    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    names = ("blue", "green", "red")
    jobs = []
    for i in range(images):
        split = "test" if i < held else "val" if i < 2 * held else "train"
        (folder / split / names[i % 3]).mkdir(parents=True, exist_ok=True)
        jobs.append((i, side, i % 3, str(folder / split / names[i % 3] / f"{i:06d}.jpg")))
    with get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(_write_jpegs, jobs, chunksize=200)
    (folder / "done").write_text("")
    return folder


# -------------------------------------------------------------------------------- in a fresh process

def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that ended (the decode's workers)."""
    return sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))


def child_open(folder: str, data_dir: str, image_size: str | None) -> dict:
    """One `load_dataset` of the folder (at `image_size`, None: its own): its wall and CPU seconds
    (this process has imported torch already, before the clocks start)."""
    from towerlab.catalog.datasets import parse_image_size
    from towerlab.data.folders import FolderOptions
    from towerlab.data.load import load_dataset

    reading = FolderOptions(image_size=parse_image_size(image_size) if image_size else None)
    cpu, started = _cpu_seconds(), time.perf_counter()
    data = load_dataset(folder, data_dir, val_size=5000, folder=reading, log=lambda line: None)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    meta = json.loads((Path(data.source["cache"]) / "meta.json").read_text())
    return {"seconds": seconds, "cpu_seconds": cpu, "n": data.n_train + data.n_val + data.n_test,
            "pass2_seconds": meta["decode_seconds"], "cores": meta["cores"],
            "cache_bytes": (Path(data.source["cache"]) / "x.npy").stat().st_size}


def child_train(folder: str, data_dir: str, image_size: str, release: bool) -> dict:
    """An MLP of 8 neurons (little computation per byte read: the epoch reads the whole cache in
    minutes) for one epoch over the folder's cache (at `image_size`); this process's peak RSS."""
    import towerlab.training.batches as batches
    from towerlab.api import train

    if not release:
        batches.release_pages = lambda address: None
    out = tempfile.mkdtemp(prefix="towerlab-bench-")
    try:
        run = train(model="mlp", model_options={"layers": 1, "neurons": 8}, data=folder, data_dir=data_dir,
                    image_size=image_size, epochs=1, batch_size=64, devices=1, device="cpu", threads=2,
                    display_step=10**6, progress=False, out=os.path.join(out, "run"))
        summary = run.summary
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "release": release,
            "n_train": summary["n_train"], "n_val": summary["n_val"], "n_test": summary["n_test"],
            "train_seconds": summary["train_seconds"], "test_accuracy": summary["test_accuracy"]}


def _child(*args: str) -> tuple[dict, dict]:
    """Run this script's `args` in a fresh process once the machine is quiet (or after a minute of
    waiting: the sample's foreign_cores then says how busy it was)."""
    command = [sys.executable, str(Path(__file__).resolve()), *args]
    wait_for_quiet(timeout=QUIET_WAIT)
    with CpuWatch() as watch:
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), watch.use.as_dict()


# ------------------------------------------------------------------------------------------ the runs

def cifar(args: argparse.Namespace) -> dict:
    folder = build_cifar(args.data_dir, Path(args.folder))
    rounds = []
    for r in range(args.rounds):
        data_dir = tempfile.mkdtemp(prefix="towerlab-bench-cache-")
        try:
            first, cpu = _child("_open", str(folder) + "/", data_dir, "")
            again = [_child("_open", str(folder) + "/", data_dir, "") for _ in range(args.reopens)]
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
        rounds.append({"decode": {**first, "cpu": cpu}, "reopen": [{**s, "cpu": c} for s, c in again]})
        print(f"round {r}: decode {first['seconds']:.2f} s, reopen "
              f"{statistics.median(s['seconds'] for s, _ in again):.3f} s", flush=True)
    def median(side: str, what: str) -> float:
        return statistics.median(s[what] for r in rounds for s in ([r[side]] if side == "decode" else r[side]))

    n, cores = rounds[0]["decode"]["n"], rounds[0]["decode"]["cores"]
    decode, reopen = median("decode", "seconds"), median("reopen", "seconds")
    decode_cpu, reopen_cpu = median("decode", "cpu_seconds"), median("reopen", "cpu_seconds")
    return {"folder": "CIFAR-10's 60,000 images as PNG files (cifar10.npz written by PIL, native 32x32)",
            "images": n, "cores": cores, "rounds": rounds,
            "figures": [
                _figure("decode_seconds", decode, "median first load_dataset: list, read and hash, decode on every "
                                                  "core, channel statistics"),
                _figure("decode_rate_per_core", n / decode_cpu,
                        "images per CPU-second (the decode's processes, all of them)"),
                _figure("decode_rate_per_core_wall", n / decode / cores, "images / wall seconds / cores"),
                _figure("decode_cpu_seconds", decode_cpu, "the same in CPU seconds, its workers' included"),
                _figure("reopen_seconds", reopen, "median later load_dataset of the same folder"),
                _figure("reopen_cpu_seconds", reopen_cpu),
                {**_figure("reopen_speedup", decode / reopen, "wall seconds"), "target_value": 20.0},
                _figure("reopen_speedup_cpu", decode_cpu / reopen_cpu, "CPU seconds")]}


def _figure(fid: str, value: float, title: str | None = None) -> dict:
    """A figure as every record holds it: its id, what it is, its value, its detail."""
    return {"id": fid, **({"title": title} if title else {}), "value": value, "detail": {}}


def large(args: argparse.Namespace) -> dict:
    folder = build_large(Path(args.folder), args.images, args.side, args.held)
    data_dir = args.cache_dir or tempfile.mkdtemp(prefix="towerlab-bench-cache-")
    size = f"{args.side}x{args.side}"
    first, cpu = _child("_open", str(folder) + "/", data_dir, size)
    print(f"decoded {first['n']:,} images into {first['cache_bytes'] / 2**30:.2f} GiB in {first['seconds']:.1f} s",
          flush=True)
    runs = {}
    for release in (True, False):
        sample, use = _child("_train", str(folder) + "/", data_dir, size, "release" if release else "keep")
        runs["released" if release else "kept"] = {**sample, "cpu": use}
        print(f"release={release}: peak RSS {sample['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    if not args.cache_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
    cache = first["cache_bytes"]
    return {"folder": f"{args.images:,} JPEG files of {args.side}x{args.side} pixels in 3 class folders; "
                      f"{args.held} in test/, {args.held} in val/, the rest in train/",
            "decode": {**first, "cpu": cpu}, "runs": runs,
            "figures": [
                _figure("cache_bytes", cache),
                _figure("peak_rss_bytes", runs["released"]["peak_rss_bytes"],
                        "an MLP (1 layer of 8), one epoch over the cache, batch 64, 1 process x 2 threads"),
                _figure("cache_over_rss", cache / runs["released"]["peak_rss_bytes"]),
                _figure("peak_rss_bytes_pages_kept", runs["kept"]["peak_rss_bytes"],
                        "the same with each batch's pages left mapped")]}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        kind, folder, data_dir, size, *rest = sys.argv[1:]
        result = child_open(folder, data_dir, size or None) if kind == "_open" \
            else child_train(folder, data_dir, size, rest[0] == "release")
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("cifar", "large"))
    parser.add_argument("--data-dir", default=default_data_dir(), help="where cifar10.npz is")
    parser.add_argument("--folder", default=None, help="the image folder to write (default: under the temp folder)")
    parser.add_argument("--cache-dir", default=None, help="large: keep the cache here (default: a temporary one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reopens", type=int, default=5)
    parser.add_argument("--images", type=int, default=40000)
    parser.add_argument("--side", type=int, default=256)
    parser.add_argument("--held", type=int, default=300, help="large: images in test/, and as many in val/")
    parser.add_argument("--note", default="", help="what the record should say of the machine (shared, nice)")
    parser.add_argument("--out-dir", default=str(RESULTS / "speed"))
    args = parser.parse_args()
    args.folder = args.folder or os.path.join(tempfile.gettempdir(), f"towerlab-bench-{args.kind}-folder")
    result = cifar(args) if args.kind == "cifar" else large(args)
    record = {"date": f"{datetime.now():%Y-%m-%d %H:%M:%S}", "machine": describe(), "note": args.note,
              "command": script_command(__file__), **result}
    path = write_record(args.out_dir, f"image-folder-{args.kind}-{datetime.now():%Y-%m-%d}.json", record)
    print(json.dumps(result["figures"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
