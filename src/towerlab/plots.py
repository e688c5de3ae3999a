"""The search's figures: fitness.png (best, mean and worst validation accuracy per generation) and
accuracy_time.png (validation accuracy against training time), drawn off-screen and written atomically;
for a search of your own objective, its metric's values, by its name.
matplotlib is imported when a figure is drawn, not before. A value beyond ±PLOTTED (an objective's 1e308:
matplotlib's ticks over such a span are no numbers) is left out of a figure, which says how many were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from towerlab import atomic

PLOTTED = 1e300  # the largest value a figure draws


def _drawn(value: Any) -> bool:
    return value is not None and abs(value) <= PLOTTED


def _say_left_out(ax: Any, count: int) -> None:
    if count:
        ax.text(0.01, 0.01, f"{count} value(s) beyond ±{PLOTTED:g} not drawn", transform=ax.transAxes, fontsize=7)


def _save_figure(fig: Any, path: Path) -> None:
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic.write_bytes(path, buffer.getvalue())


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (importing it takes a second or more, once a process)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_time(records: list[dict], path: Path, title: str) -> None:
    """accuracy_time.png: `accuracy_time_figure` of `records` (written atomically)."""
    _save_figure(accuracy_time_figure(records, title), path)


def accuracy_time_figure(records: list[dict], title: str) -> Any:
    """Validation accuracy (or the metric of your objective: each record's "value") against training time,
    one colour per search of `records` (as `towerlab.search.evaluation_records` gives them): each training
    is a point at the training seconds its search had spent when it finished (every rung and re-measure
    counted); the line is the best so far (the highest, the lowest of a minimized metric) of the
    evaluations at the search's longest training, held to the training seconds the search spent in all (a
    matplotlib Figure; the caller closes it)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    left_out = sum(r["status"] == "ok" and not _drawn(r["value"]) for r in records)
    records = [r for r in records if r["status"] != "ok" or _drawn(r["value"])]
    for search in sorted({r["search"] for r in records}):
        rows = [r for r in records if r["search"] == search]
        longest = max(r["max_epochs"] or 0 for r in rows)
        better = min if rows[0]["direction"] == "minimize" else max
        spent, points, best, curve = 0.0, [], None, []
        for r in rows:
            spent += r["seconds"]
            if r["status"] != "ok":
                continue
            points.append((spent, r["value"]))
            if (r["max_epochs"] or 0) == longest and r["replicate"] == 0:
                best = r["value"] if best is None else better(best, r["value"])
                curve.append((spent, best))
        if curve and curve[-1][0] < spent:  # the best held while the rest trained: lower rungs, re-measures
            curve.append((spent, best))
        label = f"search {search}: {rows[0]['sampler']}"
        line = ax.step(*zip(*curve), where="post", label=label)[0] if curve else None
        if points:
            ax.plot(*zip(*points), ".", alpha=0.4, color=line.get_color() if line else None,
                    label=None if line else label)
    metrics = sorted({r["metric"] for r in records})
    _say_left_out(ax, left_out)
    _label_axes(ax, "training seconds spent", title,
                "validation accuracy" if metrics == ["val_accuracy"] else metrics[0] if len(metrics) == 1 else "value")
    return fig


def plot_fitness(stats: list[dict], path: Path, title: str, label: str = "validation accuracy") -> None:
    """fitness.png: best, mean and worst validation accuracy (what `label` names) per generation (written
    atomically)."""
    _save_figure(fitness_figure(stats, title, label), path)


def fitness_figure(stats: list[dict], title: str, label: str = "validation accuracy") -> Any:
    """The figure of fitness.png (a matplotlib Figure; the caller closes it)."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    generations = [s["generation"] for s in stats]  # a record's generation counts from 1 (GenerationStats.record)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    left_out = 0
    for key, style in (("best", "-o"), ("mean", "--s"), ("worst", ":^")):
        points = [(g, s[key]) for g, s in zip(generations, stats) if _drawn(s[key])]
        left_out += sum(s[key] is not None and not _drawn(s[key]) for s in stats)
        if points:
            ax.plot(*zip(*points), style, label=key)
    _say_left_out(ax, left_out)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # generations are whole: no tick at 1.5
    _label_axes(ax, "generation", title, label)
    return fig


def _label_axes(ax: Any, xlabel: str, title: str, ylabel: str) -> None:
    """A search plot's axes: `ylabel` over `xlabel`, a grid, and a legend where a line has a label."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # not when every candidate failed
        ax.legend()
