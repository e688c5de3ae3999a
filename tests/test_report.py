"""What rank 0 draws: fitness.png's axes."""

import matplotlib.pyplot as plt
import pytest

from towerlab.report import fitness_figure


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
