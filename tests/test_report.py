"""What rank 0 draws: fitness.png's axes, accuracy_time.png's lines."""

import matplotlib.pyplot as plt
import pytest

from towerlab.plots import accuracy_time_figure, fitness_figure


@pytest.mark.parametrize("generations", [2, 3, 7])
def test_fitness_plot_ticks_whole_generations(generations):
    stats = [{"generation": g, "best": 0.9, "mean": 0.8, "worst": None if g == 0 else 0.5}
             for g in range(generations)]
    fig = fitness_figure(stats, "evolve")
    try:
        ax = fig.axes[0]
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert all(float(t).is_integer() for t in ticks)
        assert len(ticks) >= 2
    finally:
        plt.close(fig)


def _record(search, max_epochs, seconds, val, replicate=0, status="ok", sampler="ga", metric="val_accuracy",
            direction="maximize"):
    return {"search": search, "sampler": sampler, "max_epochs": max_epochs, "replicate": replicate,
            "seconds": seconds, "status": status, "metric": metric, "direction": direction,
            "value": val if status == "ok" else None}


def test_accuracy_time_line_holds_the_best_to_the_end_of_each_search():
    records = [_record(1, 1, 2.0, 0.80), _record(1, 3, 3.0, 0.90), _record(1, 3, 1.0, 0.85),
               _record(1, 1, 4.0, 0.95),                # a lower rung: a point, not on the line
               _record(1, 3, 5.0, 0.88, replicate=1),   # a re-measure: a point, not on the line
               _record(1, 3, 1.5, None, status="failed"),
               _record(2, 3, 1.0, 0.70, sampler="tpe"), _record(2, 3, 1.0, 0.75, sampler="tpe")]
    fig = accuracy_time_figure(records, "two searches")
    try:
        ax = fig.axes[0]
        lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
        assert sorted(lines) == ["search 1: ga", "search 2: tpe"]
        first = lines["search 1: ga"]
        assert list(first.get_xdata()) == [5.0, 6.0, 16.5]
        assert list(first.get_ydata()) == [0.90, 0.90, 0.90]
        second = lines["search 2: tpe"]
        assert list(second.get_xdata()) == [1.0, 2.0]  # its last training is on the line: nothing added
        assert list(second.get_ydata()) == [0.70, 0.75]
        points = [line for line in ax.get_lines() if line.get_marker() == "."]
        assert [list(p.get_ydata()) for p in points] == [[0.80, 0.90, 0.85, 0.95, 0.88], [0.70, 0.75]]
    finally:
        plt.close(fig)


def test_accuracy_time_of_a_minimized_metric_holds_its_lowest_and_names_it():
    records = [_record(1, 2, 1.0, 0.5, metric="loss", direction="minimize"),
               _record(1, 2, 1.0, 0.3, metric="loss", direction="minimize"),
               _record(1, 2, 1.0, 0.4, metric="loss", direction="minimize")]
    fig = accuracy_time_figure(records, "loss")
    try:
        ax = fig.axes[0]
        line = next(line for line in ax.get_lines() if line.get_label() == "search 1: ga")
        assert list(line.get_ydata()) == [0.5, 0.3, 0.3] and ax.get_ylabel() == "loss"
    finally:
        plt.close(fig)
