"""``compare.png``: what a comparison found, drawn so that a person can read it.

Left: each client's final held-out loss by strategy (mean over seeds, their spread as error bars), each client named
by its tasks. Right: the worst client's loss per round. A strategy has the same colour in every report (its base
name picks it from a fixed palette; a variant with run-config overrides keeps its base's colour with a hatch and a
dashed line), and the legend sits below both axes, where it covers no bar.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Okabe-Ito's colour-blind-safe palette, then a few more: one per registered strategy, in a fixed order
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999")
BASE_ORDER = ("local", "fedavg", "fedavg-dual", "fedsa-lora", "simgrad", "atlas", "mira", "vemoe")
HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")
LINESTYLES = ("-", "--", ":", "-.")


def colour_of(label: str) -> str:
    """The colour of a strategy label, the same in every report: fixed for the registered strategies, a stable pick
    for any other name (``fedavg:lora.r=2`` has ``fedavg``'s)."""
    base = label.partition(":")[0]
    if base in BASE_ORDER:
        return PALETTE[BASE_ORDER.index(base)]
    return PALETTE[len(BASE_ORDER) + sum(map(ord, base)) % (len(PALETTE) - len(BASE_ORDER))]


def variant_index(label: str, labels: Sequence[str]) -> int:
    """0 for a plain strategy; 1, 2, ... for its variants in the order the report lists them (hatch and line)."""
    if ":" not in label:
        return 0
    base = label.partition(":")[0]
    return 1 + [x for x in labels if x.partition(":")[0] == base and ":" in x].index(label)


def client_labels(rows: Sequence[dict[str, Any]], clients: Sequence[int]) -> list[str]:
    """``client 3`` with its tasks beneath, wrapped (from the rows' ``tasks``), as the x-axis names them."""
    tasks = {r["client"]: str(r["tasks"]).replace(",", ", ") for r in rows if r.get("tasks")}
    width = max(8, 96 // max(len(clients), 1))  # characters a line, so that neighbours' names do not overlap
    return [
        f"client {c}\n{textwrap.fill(tasks[c], width, break_long_words=False)}" if c in tasks else f"client {c}"
        for c in clients
    ]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Write the comparison's figure to ``path`` (see the module docstring)."""
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(rows: list[dict[str, Any]]):
    """The comparison's matplotlib figure (``plot`` writes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    from bench.report import client_metric, final_round, over_seeds, strategies_in, worst_by_round

    strategies = strategies_in(rows)
    clients = sorted({r["client"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.0))
    width = 0.8 / max(len(strategies), 1)
    for i, strategy in enumerate(strategies):
        colour, variant = colour_of(strategy), variant_index(strategy, strategies)
        mine = [r for r in rows if r["strategy"] == strategy]
        seeds = sorted({r["seed"] for r in mine})
        finals = [
            client_metric(mine, strategy, s, final_round([r for r in mine if r["seed"] == s]), "eval_loss")
            for s in seeds
        ]
        stats = [over_seeds(f.get(c, float("nan")) for f in finals) for c in clients]
        left.bar(
            np.arange(len(clients)) + i * width,
            [s.mean for s in stats],
            width,
            yerr=[s.spread for s in stats],
            label=strategy,
            color=colour,
            hatch=HATCHES[variant % len(HATCHES)],
            edgecolor="white" if variant else colour,
        )
        by_round = worst_by_round(rows, strategy)
        rounds = sorted(by_round)
        right.errorbar(
            rounds,
            [by_round[r].mean for r in rounds],
            yerr=[by_round[r].spread for r in rounds],
            color=colour,
            linestyle=LINESTYLES[variant % len(LINESTYLES)],
        )
    left.set_xticks(np.arange(len(clients)) + 0.4 - width / 2, client_labels(rows, clients), fontsize=8)
    left.set_ylabel("final held-out loss")
    left.set_title("per client (mean over seeds)")
    right.set_xlabel("round")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    right.set_ylabel("worst client's held-out loss")
    right.set_title("worst client per round")
    columns = min(len(strategies), 4) or 1
    fig.legend(loc="lower center", ncol=columns, fontsize=8, frameon=False)
    legend_rows = -(-len(strategies) // columns)
    fig.tight_layout(rect=(0, min(0.06 * legend_rows + 0.02, 0.5), 1, 1))  # room below the axes for the legend
    return fig
