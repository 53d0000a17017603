"""PNG figures every run has, drawn from ``metrics.jsonl`` rows (eval loss per client), and the helpers strategies' own
plots share (``strategies/<name>/plots.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from common.logs import get_logger

log = get_logger("tessera.plots")
T = TypeVar("T")


def pyplot():
    """matplotlib's pyplot, drawing to files, every text plain: labels, titles and legends carry what members
    report (task sets, model names), and a ``$\\foo$`` there must be drawn as written, not parsed as math text (an
    unknown symbol raised) or handed to LaTeX. Every figure here calls this before it makes a text."""
    import matplotlib

    matplotlib.use("Agg")  # files only; servers have no display
    matplotlib.rcParams.update({"text.parse_math": False, "text.usetex": False})
    import matplotlib.pyplot as plt

    return plt


def drawn(name: str, draw: Callable[[], T], empty: T) -> T:
    """``draw()``, or ``empty`` if it raises: a figure that cannot be drawn (whatever a member reported, a full disk)
    is logged with its ``name`` and never stops a run; the figures it left open are closed."""
    plt = pyplot()
    before = set(plt.get_fignums())
    try:
        return draw()
    except Exception as err:
        log.error("figure %s not drawn, the run goes on: %s: %s", name, type(err).__name__, err, exc_info=err)
        for number in set(plt.get_fignums()) - before:
            plt.close(number)
        return empty


def client_key(row: dict[str, Any]) -> int | None:
    """Which line a client row belongs to: its partition (a resumed simulation gives clients new node ids, the same
    partitions), else its node; None for the aggregate row."""
    if row.get("node") is None:
        return None
    partition = row.get("partition_id")
    return int(partition) if partition is not None else int(row["node"])


def client_keys(rows: list[dict[str, Any]]) -> list[int]:
    """The clients' keys (see ``client_key``) in the rows, sorted; the aggregate left out."""
    return sorted({key for key in map(client_key, rows) if key is not None})


def client_label(rows: list[dict[str, Any]], key: int) -> str:
    """``partition (tasks)`` for a client key (see ``client_key``), from the rows it reported."""
    tasks = next((r.get("tasks") for r in rows if client_key(r) == key and r.get("tasks")), None)
    return f"{key} ({tasks})" if tasks else str(key)


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


def heatmap_pair(
    matrices: list[Any],
    titles: list[str],
    labels: list[str],
    title: str,
    out: Path,
    limits: list[tuple[float, float]] | None = None,
    boundaries: list[int] | None = None,
) -> Path:
    """Square matrices side by side, every cell annotated, rows and columns labelled alike (relevance, adjacency).

    ``limits``: each panel's colour range (default: its own min and max); ``boundaries``: a cluster label per row,
    drawn as lines between consecutive rows of different clusters (rows must be ordered by cluster to read well).
    """
    import numpy as np

    plt = pyplot()
    cuts = [i + 0.5 for i in range(len(boundaries or []) - 1) if boundaries and boundaries[i] != boundaries[i + 1]]
    fig, axes = plt.subplots(1, len(matrices), figsize=(4.5 * len(matrices), 4), squeeze=False)
    for index, (ax, values, panel) in enumerate(zip(axes[0], matrices, titles)):
        matrix = np.asarray(values if len(values) else [[np.nan]], dtype=float)
        low, high = limits[index] if limits else (float(np.nanmin(matrix)), float(np.nanmax(matrix)))
        image = ax.imshow(matrix, vmin=low, vmax=high, cmap="viridis")
        for (i, j), value in np.ndenumerate(matrix):
            colour = "white" if value < (low + high) / 2 else "black"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
        ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=90)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        for edge in cuts:
            ax.axhline(edge, color="red", linewidth=1.5)
            ax.axvline(edge, color="red", linewidth=1.5)
        ax.set_title(panel, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(title, fontsize=10)
    return save(fig, out)


def eval_loss(rows: list[dict[str, Any]], out: Path) -> Path:
    """Held-out loss per client and the example-weighted aggregate, by round."""
    plt = pyplot()
    rows = [r for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    aggregate: list[int | None] = [None] if any(r["node"] is None for r in rows) else []
    for key in [*client_keys(rows), *aggregate]:
        mine = sorted((r["round"], r["eval_loss"]) for r in rows if client_key(r) == key)
        label = "aggregate" if key is None else f"client {client_label(rows, key)}"
        ax.plot(
            [m[0] for m in mine], [m[1] for m in mine], marker="o", label=label, linewidth=2.5 if key is None else 1.2
        )
    integer_rounds(ax)
    ax.set_ylabel("held-out loss (answer tokens)")
    ax.set_title("Per-client evaluation loss")
    ax.legend(fontsize=8)
    return save(fig, out)


def final_losses(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Each client's held-out loss at its last evaluated round (client key -> loss)."""
    last: dict[int, tuple[int, float]] = {}
    for row in rows:
        key = client_key(row)
        if key is not None and row.get("eval_loss") is not None and row["round"] >= last.get(key, (-1, 0.0))[0]:
            last[key] = (row["round"], float(row["eval_loss"]))
    return {key: loss for key, (_, loss) in sorted(last.items())}


def worst_client(rows: list[dict[str, Any]], out: Path) -> Path:
    """The worst client's held-out loss by round (which client it is, annotated), beside the mean client's."""
    plt = pyplot()
    by_round: dict[int, dict[int, float]] = {}
    for row in rows:
        key = client_key(row)
        if key is not None and row.get("eval_loss") is not None:
            by_round.setdefault(row["round"], {})[key] = float(row["eval_loss"])
    rounds = sorted(by_round)
    fig, ax = plt.subplots(figsize=(6, 4))
    worst = [max(by_round[r].items(), key=lambda kv: kv[1]) for r in rounds]
    ax.plot(rounds, [loss for _, loss in worst], marker="o", color="tab:red", label="worst client")
    ax.plot(rounds, [sum(by_round[r].values()) / len(by_round[r]) for r in rounds], marker="o", label="mean client")
    for r, (key, loss) in zip(rounds, worst):
        ax.annotate(client_label(rows, key), (r, loss), fontsize=7, xytext=(3, 3), textcoords="offset points")
    integer_rounds(ax)
    ax.set_ylabel("held-out loss (answer tokens)")
    ax.set_title("Worst client by round")
    ax.legend(fontsize=8)
    return save(fig, out)


def negative_transfer(rows: list[dict[str, Any]], baseline: list[dict[str, Any]], out: Path) -> Path:
    """Per client, its final held-out loss minus the same client's in a baseline run (local-only training, same
    data): above 0 the federation hurt it (negative transfer), below 0 it helped."""
    plt = pyplot()
    ours, theirs = final_losses(rows), final_losses(baseline)
    keys = [k for k in ours if k in theirs]
    diffs = [ours[k] - theirs[k] for k in keys]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(keys) + 2), 4))
    ax.bar([client_label(rows, k) for k in keys], diffs, color=["tab:red" if d > 0 else "tab:green" for d in diffs])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("final loss minus the baseline's")
    ax.set_title(f"Negative transfer: {sum(d > 0 for d in diffs)} of {len(keys)} clients above the baseline")
    ax.tick_params(axis="x", labelsize=7, rotation=45)
    ax.grid(alpha=0.3, axis="y")
    return save(fig, out)
