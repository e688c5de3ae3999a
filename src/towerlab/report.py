"""What rank 0 shows and records: console lines, the progress bar, metrics.jsonl, TensorBoard.

Other ranks get a `Reporter(None, enabled=False)`, which does nothing, so callers never test
`is_main` before reporting.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from towerlab import atomic
from towerlab.errors import UserError

# The longest a run without a progress bar (no terminal: a log, a batch job) goes without a line.
SILENCE_SECONDS = 30.0
# A phase that prints nothing of its own (a compilation, an evaluation) is named once it has lasted
# this long, and again every SILENCE_SECONDS: shorter ones stay silent, as before.
PHASE_NOTICE_SECONDS = 5.0
# With --tensorboard, about this many points of the training curve per run, so that a run shorter
# than --display-step has a curve too; each costs what a display step costs (a host sync and a
# tiny all-reduce), so a run pays for at most this many beyond its display steps.
CURVE_POINTS = 100


def stderr_line(text: str) -> None:
    """A line on stderr, at once (warnings, and what a job says before its Reporter exists)."""
    print(text, file=sys.stderr, flush=True)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, plural but for one: "1 image", "2 images"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def printable(name: object) -> str:
    """`name` (a file's path, a class folder's, a host's: what comes from outside) as a line for people
    may show it: control characters (a terminal's escape codes, newlines, tabs), undecodable bytes of a
    file name and backslashes written as Python writes them in a string (\\x1b, \\n, \\xff, \\\\), the rest
    as it is (accents and other scripts included). CSV and JSON escape names their own way."""
    text = str(name)
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for char in text:
        code = ord(char)
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (os.fsdecode's surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif not char.isprintable() and char != " ":
            out.append(f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def discard_line(_line: str) -> None:
    """A log that says nothing (for the processes that must not repeat what rank 0 says)."""


def require_tensorboard() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("--tensorboard needs the tensorboard package: pip install 'towerlab[tensorboard]'") from None
    return SummaryWriter


def closed_by_reader(stream: TextIO) -> None:
    """`stream`'s pipe was closed by its reader: point it at /dev/null, so that flushing what is
    left in its buffer (now, or as the interpreter exits) raises nothing."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _interactive(stream: TextIO) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


@contextlib.contextmanager
def phase(what: str, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Say `what` is under way (`say(f"{what} (N s so far)")`) once the block has lasted
    PHASE_NOTICE_SECONDS, and again every SILENCE_SECONDS while it lasts, from a watcher thread: the
    block itself is not touched, so a compilation or an evaluation runs as it would. Nothing is said
    of a block that ends sooner."""
    done = threading.Event()
    started = clock()

    def watch() -> None:
        wait = PHASE_NOTICE_SECONDS
        while not done.wait(wait):
            say(f"{what} ({clock() - started:.0f} s so far)")
            wait = SILENCE_SECONDS

    watcher = threading.Thread(target=watch, name="towerlab-phase", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


class Reporter:
    """`on_closed()` is called once if the console's reader goes away (`towerlab train | head -1`);
    the lines after that are dropped, the files are still written.

    Without a progress bar, a run is never silent for long: `advance` prints a progress line when
    SILENCE_SECONDS have passed since the last line (read from `clock`, a host clock: no device
    sync), and `phase` names a long phase that prints nothing of its own. `tensorboard` is the same
    on every rank (only rank 0 writes), so every rank agrees on `curve_every`."""

    def __init__(self, out_dir: Path | None, *, enabled: bool = True, progress: bool = True,
                 tensorboard: bool = False, stream: TextIO | None = None,
                 on_closed: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self.out_dir = out_dir
        self.stream = stream or sys.stdout
        self.on_closed = on_closed
        self.bar = None
        self.progress = enabled and progress and _interactive(sys.stderr)
        self.tensorboard = tensorboard
        self.clock = clock
        self.said = clock()  # when the last line was printed
        self.lock = threading.Lock()  # a phase's watcher prints from its own thread
        self.count: tuple[int, int, float, int] | None = None  # (done, total, started at, done then), with no bar
        self.tb = None
        self.metrics = None
        if enabled and out_dir is not None:
            self.metrics = open(out_dir / "metrics.jsonl", "a", encoding="utf-8")
            if tensorboard:
                self.tb = require_tensorboard()(log_dir=str(out_dir / "tb"))

    def line(self, text: str) -> None:
        if not self.enabled or self.stream is None:
            return
        with self.lock:
            self.said = self.clock()
            try:
                if self.bar is not None:
                    self.bar.write(text, file=self.stream)
                else:
                    print(text, file=self.stream, flush=True)
            except BrokenPipeError:
                closed_by_reader(self.stream)
                self.stream = None
                if self.on_closed is not None:
                    self.on_closed()

    def phase(self, what: str) -> contextlib.AbstractContextManager:
        """`phase(what, self.line)`: a long phase named on the console; nothing where this reporter
        prints nothing (other ranks, a search's candidates)."""
        if not self.enabled or self.stream is None:
            return contextlib.nullcontext()
        return phase(what, self.line, self.clock)

    def start_progress(self, total: int, done: int, unit: str = "step", *, lines: bool = False) -> None:
        """A progress bar where the terminal is interactive; elsewhere, with `lines`, a progress line
        whenever the run has been silent for SILENCE_SECONDS (`advance` counts)."""
        if self.progress and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
        if lines and self.enabled and self.bar is None:
            self.count = (done, total, self.clock(), done)
            self.said = self.clock()

    def grow(self, n: int) -> None:
        """More work joined the running bar."""
        if self.bar is not None and n:
            self.bar.total += n
            self.bar.refresh()

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
        elif self.count is not None:
            done, total, started, first = self.count
            self.count = (done + n, total, started, first)
            now = self.clock()  # a host clock, read at every step: cheap, and never waits for the device
            if now - self.said >= SILENCE_SECONDS:
                self.line(format_progress(done + n, total, (done + n - first) / max(now - started, 1e-9)))

    def curve_every(self, total: int, display_step: int) -> int:
        """The steps between the training curve's points beyond the display steps' (0: none): about
        CURVE_POINTS a run with --tensorboard, none where the display steps give as many."""
        if not self.tensorboard:
            return 0
        every = max(1, -(-total // CURVE_POINTS))
        return every if every < display_step else 0

    def scalars(self, kind: str, step: int, **values: float) -> None:
        """TensorBoard scalars `kind/NAME` at `step`, without a metrics.jsonl line."""
        if self.enabled and self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(f"{kind}/{key}", value, step)

    def record(self, kind: str, **fields: Any) -> None:
        """One line of metrics.jsonl (flushed at once, so a crash loses nothing written) and the
        numeric fields as TensorBoard scalars."""
        if not self.enabled:
            return
        if self.metrics is not None:
            self.metrics.write(atomic.json_text({"kind": kind, **fields}, sort_keys=True) + "\n")
            self.metrics.flush()
        if self.tb is not None and "step" in fields:
            for key, value in fields.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(f"{kind}/{key}", value, fields["step"])

    def end_progress(self) -> None:
        self.count = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.end_progress()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metrics.jsonl lines written after the checkpoint a resumed run restarts from, so the
    file reads as if the run had never been interrupted."""
    if not path.exists():
        return
    kept = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a line torn by the crash
        if record.get("step", 0) <= last_step and record.get("kind") not in ("test", "summary"):
            kept.append(raw)
    atomic.write_text(path, "".join(line + "\n" for line in kept))


def format_step(step: int, loss: float, accuracy: float, examples_per_sec: float) -> str:
    return (f"Step {step}: Minibatch Loss= {loss:.4f}, Training Accuracy= {accuracy:.3f}, "
            f"{examples_per_sec:.0f} Examples/sec")


def format_progress(done: int, total: int, per_second: float, unit: str = "step") -> str:
    """The line a run without a progress bar prints after SILENCE_SECONDS without one."""
    pace = f"{per_second:.1f} {unit}s/s" if per_second >= 1 else f"{1 / max(per_second, 1e-9):.1f} s/{unit}"
    left = f", about {duration((total - done) / per_second)} left" if per_second > 0 and total > done else ""
    return f"Progress: {unit} {done}/{total} ({100 * done / max(total, 1):.0f}%), {pace}{left}"


def format_epoch(where: str, val_loss: float | None, val_accuracy: float | None, seconds: float) -> str:
    """An evaluation line; `where` is "Epoch 3/10", or "Step 20/20 (epoch 0.19)" under --steps."""
    if val_accuracy is None:
        return f"{where}: no validation set ({seconds:.1f} s)"
    return (f"{where}: Validation Loss= {val_loss:.4f}, "
            f"Validation Accuracy= {val_accuracy:.4f} ({seconds:.1f} s)")


def format_final(summary: dict) -> str:
    test = summary.get("test_accuracy")
    parts = [f"Test Accuracy= {test:.4f}" if test is not None else "no test set",
             f"training {summary['train_seconds']:.1f} s",
             f"setup {summary['setup_seconds']:.1f} s",
             f"wall {summary['wall_seconds']:.1f} s",
             f"{summary['examples_per_sec']:.0f} Examples/sec",
             f"{summary['world_size']} x {summary['device_type']}"
             + (f", {summary['step']} step" if summary.get("step") else "")]
    if summary.get("data_fallback"):
        # The main job offline ends near 37%: say at once that this is the data, not a fault.
        parts.append(f"OFFLINE FALLBACK DATA, not the full dataset: {summary['n_train']} training images, "
                     f"{summary['steps']} steps, so an accuracy below full MNIST's is expected")
    return "Done: " + " | ".join(parts)


def format_generation(stats: Any, generations: int) -> str:
    """`stats` is a towerlab.search GenerationStats."""
    best, mean, worst = ("-" if x is None else f"{x:.4f}" if abs(x) < 1e6 else f"{x:.6g}"  # 1e308: not 309 digits
                         for x in (stats.best, stats.mean, stats.worst))
    replayed = " (from the store)" if getattr(stats, "replayed", False) else ""
    return (f"Generation {stats.generation + 1}/{generations}: evaluated {stats.evaluated}, cached {stats.cached}, "
            f"failed {stats.failed} | best {best} mean {mean} worst {worst} | "
            f"{stats.seconds:.1f} s{replayed}")


def format_plan(plan: dict) -> str:
    """What a search's budget holds (`towerlab.search.plan.planned_trainings`), said before it starts."""
    promotions = f", {plan['rungs']} promotions to longer rungs" if plan["rungs"] else ""
    tests = (f" and at most {plan['test']} to test the top (none where each was tested as it trained)"
             if plan["test"] else "")  # a search of your own objective tests nothing
    return (f"Budget: at most {plan['search']} trainings for the search{promotions}, then about "
            f"{plan['remeasure']} to re-measure the networks about to be crowned (more when that reorders them)"
            f"{tests}: about {plan['epochs']} epochs of training")


def format_estimate(seconds: float, epochs: int, plan: dict, workers: int) -> str:
    """The search's duration guessed from its first training (`seconds` for `epochs` epochs)."""
    whole = seconds / max(1, epochs) * plan["epochs"] / max(1, workers)
    return (f"The first training took {seconds:.1f} s for {epochs} epoch(s): at that pace the budget's "
            f"{plan['epochs']} epochs on {workers} worker(s) take about {duration(whole)} (a guess from one network: "
            f"larger ones take longer; early stopping and the store's cache, less)")


def duration(seconds: float) -> str:
    """60 s -> "1 min", 5400 s -> "1.5 h": the unit a reader plans with."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else \
        f"{seconds / 3600:.1f} h"


def format_cost(cost: dict) -> str:
    """The trainings a search made, by purpose (its summary's "cost")."""
    names = {"search": "for the search", "remeasure": "for re-measuring", "test": "for testing"}
    parts = [f"{cost[k]['trainings']} {name} ({cost[k]['train_seconds']:.1f} s)" for k, name in names.items()]
    return "Trainings: " + ", ".join(parts) + f": {sum(cost[k]['epochs'] for k in names)} epochs given in all"


def format_top(rows: list[dict], metric: str | None = None) -> str:
    """The final table: rank, validation accuracy (the mean over its seeds) and its spread, test
    accuracy, genome; or for the `metric` of an objective of yours ("loss, minimized"), its value (the
    rows' "value", the mean over its seeds) and spread, and no test accuracy."""
    named = None if metric is None else metric.partition(",")[0][:10]
    lines = [f"Top {len(rows)} (fitness = {metric}, the mean over its seeds):" if named else
             f"Top {len(rows)} networks (fitness = validation accuracy, the mean over its seeds):",
             f"  {'#':>2}  {named:>10}  {'+-':>6}  {'seeds':>5}  genome" if named else
             f"  {'#':>2}  {'val acc':>7}  {'+-':>6}  {'seeds':>5}  {'test acc':>8}  genome"]
    for i, row in enumerate(rows, 1):
        genome = ", ".join(f"{k}={v}" for k, v in row["genome"].items())
        if named:
            spread = "-" if row.get("value_sd") is None else f"{row['value_sd']:.4g}"
            lines.append(f"  {i:>2}  {row['value']:>10.6g}  {spread:>6}  {len(row['seeds']):>5}  {genome}")
            continue
        test = "-" if row.get("test_accuracy") is None else f"{row['test_accuracy']:.4f}"
        spread = "-" if row.get("val_accuracy_sd") is None else f"{row['val_accuracy_sd']:.4f}"
        lines.append(f"  {i:>2}  {row['val_accuracy']:.4f}  {spread:>6}  {len(row['seeds']):>5}  {test:>8}  {genome}")
    return "\n".join(lines)
