"""ATLAS's figures: the fingerprints' PCA coloured by cluster and by task (per clustering round), and the held-out
loss of every cluster by round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.plots import integer_rounds, pyplot, save


def fingerprints(server_round: int, families: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per family clustered this round: the first two PCA components of each client's fingerprint, coloured by
    cluster (left) and by task set (right), each point labelled with its partition."""
    paths = []
    for family, row in sorted(families.items()):
        points = row.get("points") or []
        if not points or "clusters" not in row or row.get("clustered_round") != server_round:
            continue
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        tasks = sorted(set(row["tasks"]))
        for ax, colours, title in (
            (axes[0], row["clusters"], f"clusters (k={row['k']}, purity {row['purity']:.2f})"),
            (axes[1], [tasks.index(t) for t in row["tasks"]], "task sets"),
        ):
            xs = [p[0] for p in points]
            ys = [p[1] if len(p) > 1 else 0.0 for p in points]
            ax.scatter(xs, ys, c=colours, cmap="tab10", vmin=0, vmax=9, s=60)
            for x, y, partition, task in zip(xs, ys, row["partitions"], row["tasks"]):
                ax.annotate(f"p{partition} {task}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("PC 1")
            ax.set_ylabel("PC 2")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        variance = row.get("explained_variance")
        fig.suptitle(f"round {server_round}, {family}: fingerprints (explained variance {variance or 0:.2f})")
        paths.append(save(fig, out_dir / f"round-{server_round:03d}-{family}.png"))
    return paths


def cluster_of_partition(aggregate_row: dict[str, Any]) -> dict[int, str]:
    """partition -> ``<family>-c<group>`` from an aggregate row's ``atlas`` report."""
    out = {}
    for family, row in (aggregate_row.get("atlas") or {}).items():
        for partition, group in zip(row.get("partitions", []), row.get("groups", [])):
            out[int(partition)] = f"{family}-c{group}"
    return out


def cluster_loss(rows: list[dict[str, Any]], out: Path) -> Path:
    """Mean held-out loss of every group's clients by round (round 0: the groups of round 1)."""
    plt = pyplot()
    groups_by_round = {r["round"]: cluster_of_partition(r) for r in rows if r.get("node") is None and r.get("atlas")}
    first = groups_by_round[min(groups_by_round)] if groups_by_round else {}
    losses: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        if row.get("node") is None or row.get("eval_loss") is None or row.get("partition_id") is None:
            continue
        groups = groups_by_round.get(row["round"]) or first
        group = groups.get(int(row["partition_id"]))
        if group is not None:
            losses.setdefault(group, {}).setdefault(row["round"], []).append(float(row["eval_loss"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for group, by_round in sorted(losses.items()):
        rounds = sorted(by_round)
        ax.plot(rounds, [sum(by_round[r]) / len(by_round[r]) for r in rounds], marker="o", label=group)
    integer_rounds(ax)
    ax.set_ylabel("held-out loss (mean over the cluster's clients)")
    ax.set_title("Per-cluster evaluation loss")
    ax.legend(fontsize=8)
    return save(fig, out)


def rank_allocation(server_round: int, families: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per family: every client's smallest, mean and largest LoRA rank against its memory budget, coloured by
    cluster (seed 003's rank-allocation figure), on the rounds ranks were allocated."""
    paths = []
    for family, row in sorted(families.items()):
        if not row.get("ranks") or row.get("clustered_round") != server_round:
            continue
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        cluster_of = dict(zip(row["partitions"], row["clusters"]))
        for key, ranks in sorted(row["ranks"].items(), key=lambda kv: int(kv[0])):
            partition, budget = int(key), row["budget_mb"][key]
            low, mean, high = min(ranks), sum(ranks) / len(ranks), max(ranks)
            colour = pyplot().get_cmap("tab10")(cluster_of[partition] % 10)
            ax.errorbar([budget], [mean], yerr=[[mean - low], [high - mean]], fmt="o", color=colour, capsize=4)
            ax.annotate(
                f"p{partition} c{cluster_of[partition]}",
                (budget, mean),
                fontsize=7,
                xytext=(4, 2),
                textcoords="offset points",
            )
        ax.set_xlabel("memory budget (MB)")
        ax.set_ylabel("LoRA rank per layer (min / mean / max)")
        ax.set_title(f"round {server_round}, {family}: rank allocation", fontsize=9)
        ax.grid(alpha=0.3)
        paths.append(save(fig, out_dir / f"round-{server_round:03d}-{family}.png"))
    return paths


def by_cluster(families: dict[str, Any]) -> dict[str, Any]:
    """The families with an adjacency (``atlas.laplacian-eta`` > 0), their partitions, tasks, clusters and adjacency
    rows and columns put in cluster order, so MIRA's heatmap draws the cluster boundaries between blocks."""
    out = {}
    for family, row in families.items():
        if not row.get("adjacency") or "clusters" not in row:
            continue
        order = sorted(range(len(row["clusters"])), key=lambda i: (row["clusters"][i], i))
        out[family] = {
            **row,
            "partitions": [row["partitions"][i] for i in order],
            "tasks": [row["tasks"][i] for i in order],
            "clusters": [row["clusters"][i] for i in order],
            "adjacency_raw": _permuted(row["adjacency_raw"], order),
            "adjacency": _permuted(row["adjacency"], order),
        }
    return out


def _permuted(matrix: list[list[float]], order: list[int]) -> list[list[float]]:
    return [[matrix[i][j] for j in order] for i in order]
