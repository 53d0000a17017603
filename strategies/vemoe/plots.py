"""VEMoE's figures (seed 002's outputs): the responsibility mass of every expert slot by round with the births,
prunes and merges marked; the worst client and negative transfer are the shared ``common.plots`` figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.plots import integer_rounds, pyplot, save

MARKERS = {"birth": ("tab:green", "^"), "prune": ("tab:red", "v"), "merge": ("tab:purple", "x")}


def expert_utilization(rows: list[dict[str, Any]], out: Path) -> Path:
    """Total responsibility of every slot per round (sum over clients of r_ik), events marked at their slot."""
    plt = pyplot()
    pool = sorted((r["round"], r["vemoe"]) for r in rows if r.get("node") is None and r.get("vemoe"))
    fig, ax = plt.subplots(figsize=(7, 4))
    slots = len(pool[0][1]["responsibility"]) if pool else 0
    for slot in range(slots):
        values = [(rnd, p["responsibility"][slot]) for rnd, p in pool]
        if any(v for _, v in values):
            ax.plot([r for r, _ in values], [v for _, v in values], marker="o", label=f"expert {slot}")
    for rnd, p in pool:
        for event in p.get("events", []):
            colour, marker = MARKERS.get(event["kind"], ("black", "o"))
            ax.scatter([rnd], [p["responsibility"][event["slot"]]], s=120, color=colour, marker=marker, zorder=3)
            ax.annotate(f"{event['kind']} {event['slot']}", (rnd, p["responsibility"][event["slot"]]), fontsize=7)
    integer_rounds(ax)
    ax.set_ylabel("responsibility mass (sum over clients)")
    # "experts" counts the pool after the round's events, so a round that merged shows fewer than it trained
    most = max((p["experts"] for _, p in pool), default=0)
    ax.set_title(f"Expert utilization ({slots} slots; at most {most} experts after a round's events)")
    if slots:
        ax.legend(fontsize=7, ncol=2)
    return save(fig, out)
