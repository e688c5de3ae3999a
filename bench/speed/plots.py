"""scaling.png and time_to_accuracy.png from the figures of one benchmark run (matplotlib, Agg)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")


def draw(figures: list[dict], out_dir: Path, suffix: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    drawn = []
    scaling = [f for f in figures if f["id"].startswith("scaling_") and f.get("value") is not None]
    if scaling:
        drawn.append(_scaling(scaling, out_dir / f"scaling{suffix}.png"))
    tta = [f for f in figures if f.get("tta") and f.get("samples")]
    if tta:
        drawn.append(_time_to_accuracy(tta, out_dir / f"time_to_accuracy{suffix}.png"))
    return drawn


def _scaling(figures: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figures), figsize=(5.5 * len(figures), 4.6), squeeze=False)
    for ax, figure in zip(axes[0], figures):
        sweep = sorted(figure["detail"]["sweep"], key=lambda row: row["batch_per_replica"])
        xs = range(len(sweep))
        one = [row["devices1"] or 0 for row in sweep]
        two = [row["devices2"] or 0 for row in sweep]
        ax.bar([x - 0.2 for x in xs], one, 0.4, label="--devices 1 (1 thread)", color="#8da0cb")
        ax.bar([x + 0.2 for x in xs], two, 0.4, label="--devices 2 (1 thread each)", color="#fc8d62")
        ax.plot([x + 0.2 for x in xs], [1.7 * v for v in one], "_", color="#d62728", markersize=22,
                markeredgewidth=2, label="1.7x of --devices 1 (target)")
        for x, row, height in zip(xs, sweep, two):
            ratio = row["ratio"]["median"]
            if ratio:
                ax.text(x + 0.2, height * 0.5, f"x{ratio:.2f}", ha="center", va="center", rotation=90,
                        fontsize=10, color="white", weight="bold")
        ax.set_xticks(list(xs), [str(row["batch_per_replica"]) for row in sweep])
        ax.set_xlabel("batch per replica")
        ax.set_ylabel("examples / s (median)")
        ax.set_ylim(0, 1.3 * max(max(two), 1.7 * max(one)))
        ax.set_title(figure["id"].removeprefix("scaling_"))
        ax.legend(fontsize=8, loc="upper left", ncol=1)
    fig.suptitle("Data-parallel scaling on CPU: 2 processes x 1 thread vs 1 process x 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _time_to_accuracy(figures: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figures), figsize=(7 * len(figures), 4.8), squeeze=False)
    for ax, figure in zip(axes[0], figures):
        target = figure["detail"].get("target_accuracy", 0.99)
        floor = target - 0.03
        for name, runs in figure["samples"].items():
            for i, run in enumerate(runs):
                first = i == 0
                if run.get("contended"):  # another job held a core: drawn, but faint and dashed
                    style = {"alpha": 0.35, "ls": ":"}
                else:
                    style = {"alpha": 0.8, "ls": "-"}
                if "history" in run:  # the baseline: test accuracy after each epoch
                    xs = [h["train_seconds"] for h in run["history"]]
                    ys = [h["test_accuracy"] for h in run["history"]]
                    ax.plot(xs, ys, marker="o", color="#7570b3", ms=4, **style,
                            label="baseline: test accuracy per epoch" if first else None)
                else:  # towerlab: validation accuracy at each evaluation, then the test accuracy
                    evals = [e for e in run["evals"] if e["val_accuracy"] is not None]
                    ax.plot([e["train_seconds"] for e in evals], [e["val_accuracy"] for e in evals], marker=".",
                            color="#d95f02", **style, label=f"{name}: validation accuracy" if first else None)
                    s = run["summary"]
                    if s["test_accuracy"] is not None:
                        ax.plot([s["train_seconds"]], [s["test_accuracy"]], "*", color="#1b9e77", ms=13,
                                label=f"{name}: final test accuracy" if first else None)
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:.1%}")
        ax.set_ylim(floor, min(1.0, target + 0.01))
        ax.set_xscale("log")
        from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
        ax.xaxis.set_major_locator(FixedLocator([1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 500]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("training seconds, log scale (evaluation excluded); dotted: a run during which "
                      "another job held a core", fontsize=8)
        ax.set_ylabel("accuracy")
        value = figure.get("value")
        ax.set_title(figure["title"] + (f"\n{value:.2f}{figure['unit']}" if value is not None and
                                        figure.get("unit") == "x" else ""), fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
