"""PNG figures of a run, drawn from ``metrics.jsonl`` rows: eval loss per client, relevance heatmaps, PQ-LoRA gates."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; servers have no display
    import matplotlib.pyplot as plt

    return plt


def client_label(rows: list[dict[str, Any]], node: int) -> str:
    """``partition (tasks)`` for a node, from the rows it reported; the node id if it never reported."""
    tasks = next((r.get("tasks") for r in rows if r["node"] == node and r.get("tasks")), None)
    pid = next((r.get("partition_id") for r in rows if r["node"] == node and r.get("partition_id") is not None), None)
    return f"{pid} ({tasks})" if pid is not None else str(node)


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_xlabel("round")
    ax.grid(alpha=0.3)


def _save(fig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out


def eval_loss(rows: list[dict[str, Any]], out: Path) -> Path:
    """Held-out loss per client and the example-weighted aggregate, by round."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for node in sorted({r["node"] for r in rows}, key=lambda n: (n is None, n or 0)):
        mine = sorted((r["round"], r["eval_loss"]) for r in rows if r["node"] == node)
        label = "aggregate" if node is None else f"client {client_label(rows, node)}"
        ax.plot([m[0] for m in mine], [m[1] for m in mine], marker="o", label=label, linewidth=2.5 if node is None else 1.2)
    _integer_rounds(ax)
    ax.set_ylabel("held-out loss (answer tokens)")
    ax.set_title("Per-client evaluation loss")
    ax.legend(fontsize=8)
    return _save(fig, out)


def relevance(server_round: int, row: dict[str, Any], out: Path) -> Path:
    """Side-by-side heatmaps of the cosine relevance matrix S and the softmax weights W of one round."""
    import numpy as np

    plt = _pyplot()
    labels = [f"p{p}\n{m.split('-')[0][:8]}" for p, m in zip(row.get("relevance_partitions", []), row.get("relevance_models", []))]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, title, limits in (
        (axes[0], "relevance", "cosine relevance S", (-1, 1)),
        (axes[1], "relevance_weights", "softmax weights W (rows)", (0, 1)),
    ):
        matrix = np.asarray(row.get(key) or [[np.nan]], dtype=float)
        image = ax.imshow(matrix, vmin=limits[0], vmax=limits[1], cmap="viridis")
        for (i, j), value in np.ndenumerate(matrix):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color="white" if value < np.mean(limits) else "black")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"round {server_round}: {title}", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(fig, out)


def gates(rows: list[dict[str, Any]], out: Path) -> Path:
    """PQ-LoRA gate beta (weight of the global part) per block per client, by round."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("node") is not None and r.get("beta")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for node in sorted({r["node"] for r in rows}):
        mine = sorted((r["round"], r["beta"]) for r in rows if r["node"] == node)
        for block in range(len(mine[0][1])):
            ax.plot([m[0] for m in mine], [m[1][block] for m in mine], marker=".", label=f"client {client_label(rows, node)} block {block}")
    _integer_rounds(ax)
    ax.set_ylabel("beta (global share)")
    ax.set_title("PQ-LoRA gates")
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, out)
