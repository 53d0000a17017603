"""The fingerprint graph's figures (MIRA, and ATLAS with a Laplacian step): the adjacency of every model family,
raw and row-normalised, per round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.plots import heatmap_pair


def adjacency(server_round: int, families: dict[str, Any], out_dir: Path) -> list[Path]:
    """One figure per family: a_kl = exp(-alpha d_kl) and its row-normalised form, labelled by partition and task;
    cluster boundaries drawn where the row says which cluster each partition is in (``clusters``)."""
    paths = []
    for family, row in sorted(families.items()):
        if not row.get("adjacency"):
            continue
        labels = [f"p{p} {t}" for p, t in zip(row["partitions"], row["tasks"])]
        title = f"round {server_round}, {family}, alpha {row.get('alpha', 0):.3g}"
        target = out_dir / f"round-{server_round:03d}-{family}.png"
        paths.append(
            heatmap_pair(
                [row["adjacency_raw"], row["adjacency"]],
                ["a_kl = exp(-alpha ||f_k - f_l||^2)", "row-normalised"],
                labels,
                title,
                target,
                boundaries=row.get("clusters"),
            )
        )
    return paths
