"""The comparison plot a person reads: a strategy keeps its colour across reports, the legend covers no bar, and
each client is named by its tasks."""

from __future__ import annotations

import matplotlib
import pytest

from bench.compare_plot import BASE_ORDER, colour_of, figure, variant_index
from strategies import REGISTRY

matplotlib.use("Agg")


def _rows(labels, clients=3):
    tasks = ["boolq", "asdiv", "question generation,answer generation"]
    return [
        {"strategy": label, "seed": seed, "client": c, "round": rnd, "tasks": tasks[c], "eval_loss": 3.0 - rnd * 0.3}
        for label in labels
        for seed in (0, 1)
        for c in range(clients)
        for rnd in (0, 1, 2)
    ]


def test_a_strategy_has_one_colour_in_every_report_and_its_variants_share_it():
    assert set(REGISTRY) <= set(BASE_ORDER)  # a new strategy gets a fixed place in the palette
    assert len({colour_of(name) for name in REGISTRY}) == len(REGISTRY)
    assert colour_of("fedavg:lora.r=2 dp.record-epsilon=8") == colour_of("fedavg")
    assert colour_of("my-new-strategy") == colour_of("my-new-strategy:x=1")
    one, other = ["local", "fedavg:a=1", "fedavg:a=2"], ["fedavg:a=2", "vemoe"]
    assert variant_index("fedavg", one) == 0 and variant_index("fedavg:a=2", one) == 2
    assert variant_index("fedavg:a=2", other) == 1  # a hatch, never another colour


@pytest.mark.parametrize("count", [3, 9])
def test_the_legend_covers_no_axes_and_the_clients_are_named_by_their_tasks(count):
    labels = ["local", "fedavg", "fedavg-dual", "simgrad", "atlas", "mira", "vemoe", "fedsa-lora", "vemoe:k=1"][:count]
    fig = figure(_rows(labels))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for axes in fig.axes:
        assert not box.overlaps(axes.get_window_extent(renderer))
    assert [t.get_text() for t in legend.get_texts()] == labels
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[0] == "client 0\nboolq" and "question generation, answer generation" in " ".join(ticks[2].split())
    bars = {patch.get_facecolor() for patch in fig.axes[0].patches}
    assert len(bars) == len({colour_of(label) for label in labels})
