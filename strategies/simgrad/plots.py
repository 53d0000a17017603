"""SimGrad's figures: the relevance heatmaps of a round and the PQ-LoRA gates across the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.plots import client_key, client_keys, client_label, heatmap_pair, integer_rounds, pyplot, save


def relevance(server_round: int, row: dict[str, Any], out: Path) -> Path:
    """Side-by-side heatmaps of the cosine relevance matrix S and the softmax weights W of one round."""
    labels = [
        f"p{p}\n{m.split('-')[0][:8]}"
        for p, m in zip(row.get("relevance_partitions", []), row.get("relevance_models", []))
    ]
    return heatmap_pair(
        [row.get("relevance") or [], row.get("relevance_weights") or []],
        ["cosine relevance S", "softmax weights W (rows)"],
        labels,
        f"round {server_round}",
        out,
        limits=[(-1, 1), (0, 1)],
    )


def gates(rows: list[dict[str, Any]], out: Path) -> Path:
    """PQ-LoRA gate beta (weight of the global part) per block per client, by round."""
    plt = pyplot()
    rows = [r for r in rows if r.get("node") is not None and r.get("beta")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in client_keys(rows):
        mine = sorted((r["round"], r["beta"]) for r in rows if client_key(r) == key)
        for block in range(len(mine[0][1])):
            ax.plot(
                [m[0] for m in mine],
                [m[1][block] for m in mine],
                marker=".",
                label=f"client {client_label(rows, key)} block {block}",
            )
    integer_rounds(ax)
    ax.set_ylabel("beta (global share)")
    ax.set_title("PQ-LoRA gates")
    ax.legend(fontsize=6, ncol=2)
    return save(fig, out)
