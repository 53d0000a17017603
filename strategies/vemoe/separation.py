"""Whether VEMoE's routing separates the clients' categories, measured from the metrics rows (plain mode: each
client's train row carries its responsibilities ``vemoe_r``; its evaluation row its task set ``tasks``).

Per round: each client's top-1 expert (largest r, the lower slot on a tie) against its task set, and the purity of
that assignment (scikit-learn's contingency matrix: the share of clients whose expert's most common task set is
their own; 1.0 when every expert serves one task set, the share of the largest task set when one expert serves
everyone)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .wire import R_METRIC


def purity(experts: list[int], labels: list[str]) -> float:
    """Share of items whose cluster's majority label is their own."""
    from sklearn.metrics.cluster import contingency_matrix  # here: scikit-learn costs every process 1.2 s to import

    if not experts:
        raise ValueError("no clients to measure")
    table = contingency_matrix(labels, experts)  # rows: labels, columns: clusters
    return float(table.max(axis=0).sum() / table.sum())


def separation(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trained round: {round, purity, top1: {partition: expert}, tasks: {partition: task set}} for the
    clients whose row carries both their responsibilities and their task set."""
    out = []
    for rnd in sorted({r["round"] for r in rows if r.get("node") is not None and r.get(R_METRIC)}):
        clients = [
            r for r in rows if r["round"] == rnd and r.get("node") is not None and r.get(R_METRIC) and r.get("tasks")
        ]
        if not clients:
            continue
        top1 = {int(r["partition_id"]): int(np.argmax(r[R_METRIC])) for r in clients}
        tasks = {int(r["partition_id"]): str(r["tasks"]) for r in clients}
        order = sorted(top1)
        out.append(
            {
                "round": rnd,
                "purity": purity([top1[p] for p in order], [tasks[p] for p in order]),
                "top1": top1,
                "tasks": tasks,
            }
        )
    return out
