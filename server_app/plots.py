"""PNG figures every run has, drawn from ``metrics.jsonl`` rows (eval loss per client), and the helpers strategies' own
plots share (``strategies/<name>/plots.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; servers have no display
    import matplotlib.pyplot as plt

    return plt


def client_label(rows: list[dict[str, Any]], node: int) -> str:
    """``partition (tasks)`` for a node, from the rows it reported; the node id if it never reported."""
    tasks = next((r.get("tasks") for r in rows if r["node"] == node and r.get("tasks")), None)
    pid = next((r.get("partition_id") for r in rows if r["node"] == node and r.get("partition_id") is not None), None)
    return f"{pid} ({tasks})" if pid is not None else str(node)


def integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_xlabel("round")
    ax.grid(alpha=0.3)


def save(fig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out


def eval_loss(rows: list[dict[str, Any]], out: Path) -> Path:
    """Held-out loss per client and the example-weighted aggregate, by round."""
    plt = pyplot()
    rows = [r for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for node in sorted({r["node"] for r in rows}, key=lambda n: (n is None, n or 0)):
        mine = sorted((r["round"], r["eval_loss"]) for r in rows if r["node"] == node)
        label = "aggregate" if node is None else f"client {client_label(rows, node)}"
        ax.plot(
            [m[0] for m in mine], [m[1] for m in mine], marker="o", label=label, linewidth=2.5 if node is None else 1.2
        )
    integer_rounds(ax)
    ax.set_ylabel("held-out loss (answer tokens)")
    ax.set_title("Per-client evaluation loss")
    ax.legend(fontsize=8)
    return save(fig, out)
