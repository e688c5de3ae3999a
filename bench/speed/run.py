"""towerlab's speed benchmark: time to accuracy, throughput and scaling, against plain PyTorch.

    python bench/speed/run.py --suite cpu                  # the full CPU suite (about 15-20 minutes on 2 cores)
    python bench/speed/run.py --suite cpu --quick          # a smoke run of every figure (a few minutes)
    python bench/speed/run.py --suite gpu                  # needs CUDA (one H100 in the targets)

Prints a table, writes bench/results/{speed,gpu}/<suite>-<YYYY-MM-DD>.json (the machine, every figure with its
raw samples, the commands) and draws bench/results/speed/scaling.png and time_to_accuracy.png. Every
comparison alternates its sides within this invocation and reports medians; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import BENCH, REPO, RESULTS, script_command, write_record


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_changes(quick: bool, rounds: int | None) -> dict:
    """bench/speed/changes.py in a fresh 1-thread process (the before/after of each speed change)."""
    handle, path = tempfile.mkstemp(prefix="changes-", suffix=".json")
    os.close(handle)
    cmd = [sys.executable, str(BENCH / "speed" / "changes.py"), "--json", path] + (["--quick"] if quick else [])
    if rounds:
        cmd += ["--rounds", str(rounds)]
    log("[changes] before/after of each speed change, 1 thread, alternating")
    machine.wait_for_quiet(log=log)
    with machine.CpuWatch() as watch:
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        record = json.loads(Path(path).read_text())
    finally:
        os.unlink(path)
    record["cpu"] = watch.use.as_dict()
    record["command"] = ["python", "bench/speed/changes.py"] + (["--quick"] if quick else [])
    return record


def round_quality(figure: dict) -> tuple[int, int]:
    """(rounds in which no other job loaded the machine, all rounds) over the figure's comparisons."""
    groups = figure.get("samples") or {}
    if groups and all(isinstance(v, dict) for v in groups.values()):  # a sweep: {batchN: {side: [...]}}
        groups = {f"{g}/{side}": runs for g, sides in groups.items() for side, runs in sides.items()}
    rounds: dict[tuple, bool] = {}
    for name, runs in groups.items():
        for run in runs:
            key = (name.split("/")[0] if "/" in name else "", run["round"])
            rounds[key] = rounds.get(key, False) or run.get("contended", False)
    return sum(not c for c in rounds.values()), len(rounds)


def format_value(figure: dict) -> str:
    value = figure.get("value")
    if value is None:
        return figure.get("status", "n/a")
    unit = figure.get("unit", "")
    text = f"{value:.2f}{unit}" if unit == "x" else f"{value:.3g} {unit}"
    clean, total = round_quality(figure)
    return text + (f" ({clean}/{total} rounds quiet)" if total and clean < total else "")


def table(figures: list[dict], changes: dict | None) -> str:
    rows = [("figure", "value", "target", "met")]
    for f in figures:
        met = {True: "yes", False: "NO", None: "-"}[f.get("met")]
        rows.append((f["title"], format_value(f), f["target"], met))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in width))
    if changes:
        lines += ["", "speed changes (1 thread, before -> after, median of alternating rounds):"]
        for c in changes["results"]:
            lines.append(f"  {c['id']:32s} {c['before_ms']:9.3f} ms -> {c['after_ms']:9.3f} ms   "
                         f"x{c['speedup']:.2f}   {c['what']}")
    return "\n".join(lines)


def dry_run(suite, selected: list[str], data_dir: str, repeats: int, quick: bool) -> int:
    """Every figure function runs with a stand-in for the training runs, so the suite's own code and
    every command it would start (checked by towerlab's parser and configs) are exercised."""
    measure.DRY_RUN = True
    figures = []
    for group in selected:
        if group != "changes":
            result = suite.FIGURES[group](data_dir, 1, quick, lambda _line: None)
            figures.extend(result if isinstance(result, list) else [result])
    for cmd in dict.fromkeys(" ".join(c) for c in measure.DRY_COMMANDS):
        print(cmd)
    print(f"dry run: {len(figures)} figures, {len(set(map(tuple, measure.DRY_COMMANDS)))} distinct commands, "
          f"all accepted by towerlab's parser" + ("; plus python bench/speed/changes.py" if "changes" in selected else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--suite", choices=("cpu", "gpu"), required=True, help="which figures")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, short runs, low targets")
    parser.add_argument("--repeats", type=int, default=None, help="alternating rounds per comparison "
                        "(default: 3; --quick: 1)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these figure groups (cpu: mnist_tta mnist_fast_layout scaling ps_vs_ddp input_modes "
                             "search changes; gpu: see bench/gpu/suite.py)")
    parser.add_argument("--data-dir", default=measure.default_data_dir(),
                        help="folder with mnist.npz and cifar10.npz ($TOWERLAB_DATA, else ../shared/data)")
    parser.add_argument("--out-dir", default=None,
                        help="where the JSON and the plots go (default: bench/results/speed, --suite gpu: "
                             "bench/results/gpu; --quick: bench/results/quick)")
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="only redraw the plots of an earlier results file (next to it)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build every command of the suite, check it with towerlab's own parser and "
                             "configs, and list them; runs nothing, writes nothing, needs no GPU")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.replot:
        from bench.speed import plots
        record = json.loads(Path(args.replot).read_text(encoding="utf-8"))
        suffix = "" if record["suite"] == "cpu" else f"-{record['suite']}"
        for path in plots.draw(record["figures"], Path(args.replot).parent, suffix=suffix):
            print(path)
        return 0
    if args.quick:  # a smoke run: no re-runs of contended rounds, short waits for quiet
        measure.EXTRA_ROUNDS, measure.QUIET_TIMEOUT = 0, 5.0

    if args.suite == "gpu":
        from bench.gpu import suite
        problem = suite.unavailable()
        if problem and not args.dry_run:
            log(f"bench: --suite gpu cannot run here: {problem}")
            return 2
    else:
        from bench.speed import suite
    data_path = Path(args.data_dir).resolve()
    shared = (REPO.parent / "shared" / "data").resolve()
    if data_path == shared:
        # The runs start in the repository root; a relative path keeps the recorded commands portable.
        args.data_dir = "../shared/data"
    else:
        args.data_dir = str(Path(args.data_dir).resolve())
    groups = list(suite.FIGURES) + ["changes"] * (args.suite == "cpu")
    unknown = sorted(set(args.only or []) - set(groups))
    if unknown:
        log(f"bench: unknown figure group(s) {', '.join(unknown)}: choose from {', '.join(groups)}")
        return 2
    selected = [g for g in groups if args.only is None or g in args.only]
    for name in sorted({d for g in selected for d in suite.NEEDS[g]}):
        if not (data_path / f"{name}.npz").exists():
            log(f"bench: {name}.npz not found in {args.data_dir} (needed by "
                f"{', '.join(g for g in selected if name in suite.NEEDS[g])}): pass --data-dir or set TOWERLAB_DATA")
            return 2
    if args.dry_run:
        return dry_run(suite, selected, args.data_dir, repeats, args.quick)

    started = time.time()
    info = machine.describe()
    log(f"bench --suite {args.suite}{' --quick' if args.quick else ''}: {info['cpu_model']}, "
        f"{info['cpu_cores']} cores, torch {info['torch']}" + (f", {info['gpu']}" if info.get("gpu") else ""))
    figures: list[dict] = []
    changes = None
    for group in selected:
        if group == "changes":
            changes = run_changes(args.quick, None if not args.repeats else max(args.repeats, 1))
            continue
        result = suite.FIGURES[group](args.data_dir, repeats, args.quick, log)
        figures.extend(result if isinstance(result, list) else [result])
    figures.extend(getattr(suite, "not_measured_here", lambda: [])())

    record = {"suite": args.suite, "quick": args.quick, "repeats": repeats, "date": measure.now(),
              "minutes": round((time.time() - started) / 60, 1), "machine": info,
              "command": script_command(__file__, argv),
              "data_dir": args.data_dir,
              "figures": figures, "changes": changes}
    out_dir = Path(args.out_dir or (RESULTS / "quick" if args.quick else RESULTS / ("speed" if args.suite == "cpu" else "gpu")))
    name = f"{args.suite}{'-quick' if args.quick else ''}-{datetime.date.today():%Y-%m-%d}.json"
    written = write_record(out_dir, name, record)
    from bench.speed import plots
    drawn = plots.draw(figures, out_dir, suffix="" if args.suite == "cpu" else f"-{args.suite}")
    print(table(figures, changes))
    log(f"\nwrote {written}" + "".join(f", {p}" for p in drawn) + f" ({record['minutes']} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
