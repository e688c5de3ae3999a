"""What the proof of what runs costs (towerlab.proof): loading a file of yours and the modules it imports
through SourceLoader, which compiles the bytes it hashed, against Python's own import from warm .pyc
files (what runs otherwise) and from sources with no .pyc (what compiling alone costs); the proof taken
after the load; an import statement run inside a function of a module so loaded (its recording
`__import__`); the import of large installed packages (torch, numpy, matplotlib, optuna) in a fresh
interpreter with SourceLoader's finder installed first or not (it hands them on as Python's own finder
would); and the SHA-256 of a large file, as a command's proof takes it for each file it names.

The user code: `objective.py` importing MODULES neighbour modules of LINES lines each (functions and a
class, as a model or training file has). The cases alternate within a round; the median of the rounds.

    python bench/proof/objective_proof.py             # 30 rounds, 6 fresh interpreters a case (~1 min)

Writes results/proof/objective-proof-<date>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine
from bench.common.record import RESULTS, script_command, write_record

import towerlab.proof as proof

MODULES, FUNCTIONS = 5, 40  # neighbour modules, and functions in each (~8 lines each: ~330 lines a module)
BLOCK = '''
def block_{n}(x, scale={n}, shift=0.5):
    """Block {n}: a few lines of arithmetic and a branch, as a layer's helper has."""
    total = 0.0
    for i, value in enumerate(x):
        total += (value * scale + shift) / (i + 1)
    if total > {n}:
        return [v - total for v in x]
    return [v + total for v in x]
'''
CLASS = '''
class Net:
    def __init__(self, width=16):
        self.width = width

    def forward(self, x):
        for name in sorted(globals()):
            if name.startswith("block_"):
                x = globals()[name](x)
        return x
'''


def user_code(folder: Path) -> list[str]:
    """Write objective.py and its neighbours into `folder`; the module names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"blocks{m}" for m in range(MODULES)]
    for name in names:
        (folder / f"{name}.py").write_text("import math\n" + "".join(BLOCK.format(n=n) for n in range(FUNCTIONS)) + CLASS)
    (folder / "objective.py").write_text("".join(f"import {name}\n" for name in names) +
                                         "\ndef train(lr):\n    import json\n    return lr\n")
    return ["objective", *names]


def _fresh(names: list[str]) -> None:
    for name in names:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()


def timed_import(folder: Path, names: list[str], ours: bool) -> float:
    """Seconds to import objective.py (and its neighbours) from `folder`, through SourceLoader or not;
    with SourceLoader, the proof is taken too."""
    _fresh(names)
    sys.path.insert(0, str(folder))
    finders = list(sys.meta_path)  # put back after: proof.install()'s finder out again, by what it was
    if ours:
        proof.install()
    try:
        started = time.perf_counter()
        importlib.import_module("objective")
        if ours:
            assert len(proof.code_proof("objective").parts) == len(names)
        return time.perf_counter() - started
    finally:
        sys.path.remove(str(folder))
        sys.meta_path[:] = finders


def import_statement_seconds(folder: Path, names: list[str], ours: bool, calls: int = 100_000) -> float:
    """Seconds per call of a function whose body imports json (served from sys.modules)."""
    _fresh(names)
    sys.path.insert(0, str(folder))
    finders = list(sys.meta_path)  # put back after: proof.install()'s finder out again, by what it was
    if ours:
        proof.install()
    try:
        train = importlib.import_module("objective").train
        started = time.perf_counter()
        for _ in range(calls):
            train(0.1)
        return (time.perf_counter() - started) / calls
    finally:
        sys.path.remove(str(folder))
        sys.meta_path[:] = finders


THIRD_PARTY = """
import sys, time
import towerlab.proof
if sys.argv[1] == "ours":
    towerlab.proof.install()
started = time.perf_counter()
import matplotlib.pyplot, numpy, optuna, torch
print(time.perf_counter() - started)
"""


def third_party_seconds(case: str) -> float:
    done = subprocess.run([sys.executable, "-c", THIRD_PARTY, case], capture_output=True, text=True, check=True)
    return float(done.stdout)


def measure(args: argparse.Namespace, tmp: Path) -> tuple[dict, dict, list[float], int]:
    """The samples of each case (see the module's docstring), and the user code's lines."""
    warm, cold = tmp / "warm", tmp / "cold"
    names = user_code(warm)
    shutil.copytree(warm, cold)
    lines = sum(len((warm / f"{name}.py").read_text().splitlines()) for name in names)
    sys.dont_write_bytecode = False
    timed_import(warm, names, ours=False)  # writes warm's .pyc files
    assert len(list((warm / "__pycache__").iterdir())) == len(names)
    sys.dont_write_bytecode = True  # cold never gets any
    loads: dict[str, list[float]] = {"pyc": [], "source": [], "ours": []}
    for _ in range(args.rounds):
        loads["pyc"].append(timed_import(warm, names, ours=False))
        loads["source"].append(timed_import(cold, names, ours=False))
        loads["ours"].append(timed_import(cold, names, ours=True))
    calls: dict[str, list[float]] = {"plain": [], "ours": [], "third_party_plain": [], "third_party_ours": []}
    for _ in range(5):
        calls["plain"].append(import_statement_seconds(warm, names, ours=False))
        calls["ours"].append(import_statement_seconds(cold, names, ours=True))
    for _ in range(args.fresh):
        for case in ("plain", "ours"):
            calls[f"third_party_{case}"].append(third_party_seconds(case))
    big = tmp / "big.bin"
    big.write_bytes(os.urandom(args.file_mb * 2**20))
    hashing = []
    for _ in range(3):
        started = time.perf_counter()
        hashlib.sha256(big.read_bytes()).hexdigest()
        hashing.append(time.perf_counter() - started)
    return loads, calls, hashing, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--file-mb", type=int, default=256)
    parser.add_argument("--fresh", type=int, default=6, help="fresh interpreters per case importing torch and others")
    parser.add_argument("--out", default=str(RESULTS / "proof"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, machine.CpuWatch() as watch:
        loads, calls, hashing, lines = measure(args, Path(tmp))
    load = {case: statistics.median(values) for case, values in loads.items()}
    call = {case: statistics.median(values) for case, values in calls.items()}
    figures = [
        {"id": "proof_load_ms", "value": load["ours"] * 1e3, "unit": "ms",
         "title": f"objective.py and {MODULES} neighbours ({lines} lines) loaded through SourceLoader, proof included",
         "detail": {"pyc_ms": load["pyc"] * 1e3, "source_ms": load["source"] * 1e3,
                    "over_pyc_ms": (load["ours"] - load["pyc"]) * 1e3,
                    "over_source_ms": (load["ours"] - load["source"]) * 1e3,
                    "ratio_to_pyc": load["ours"] / load["pyc"], "ratio_to_source": load["ours"] / load["source"],
                    "samples_ms": {case: [round(v * 1e3, 3) for v in values] for case, values in loads.items()}}},
        {"id": "proof_import_statement_us", "value": call["ours"] * 1e6, "unit": "us",
         "title": "a call of a function whose body runs `import json`, its module loaded through SourceLoader",
         "detail": {"plain_us": call["plain"] * 1e6, "over_plain_us": (call["ours"] - call["plain"]) * 1e6,
                    "samples_us": {case: [round(v * 1e6, 3) for v in calls[case]] for case in ("plain", "ours")}}},
        {"id": "proof_third_party_import_ratio", "value": call["third_party_ours"] / call["third_party_plain"],
         "unit": "x", "title": "import of torch, numpy, matplotlib and optuna in a fresh interpreter, SourceLoader's "
                               "finder installed first / not",
         "detail": {"plain_s": call["third_party_plain"], "ours_s": call["third_party_ours"],
                    "samples_s": {case: calls[f"third_party_{case}"] for case in ("plain", "ours")}}},
        {"id": "proof_file_sha256_mb_per_s", "value": args.file_mb / statistics.median(hashing), "unit": "MB/s",
         "title": f"SHA-256 of a {args.file_mb} MB file read whole (a command's proof, per file it names)",
         "detail": {"seconds": hashing}},
    ]
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.describe(),
              "command": script_command(__file__), "rounds": args.rounds,
              "notes": "The machine is shared with other sessions' jobs (2 cores): absolute times vary; the cases "
                       "alternate within each round, so their ratios are the figures to read; `cpu` says how busy "
                       "the machine was.",
              "cpu": watch.use.as_dict(), "figures": figures}
    path = write_record(args.out, f"objective-proof-{time.strftime('%Y-%m-%d')}.json", record)
    for figure in figures:
        shown = {k: v for k, v in figure["detail"].items() if not k.startswith("samples")}
        print(f"{figure['id']}: {figure['value']:.3f} {figure['unit']}  {shown}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
