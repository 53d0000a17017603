"""ATLAS's server half: clients clustered by task fingerprint, FedAvg strictly inside each cluster.

Each base-model family's fingerprints are PCA-reduced, clustered by k-means with k chosen by seed 003's combined
score (or fixed by ``atlas.k``, or given by the clients' task sets with ``atlas.clustering = "oracle"``), and every
cluster averages its members' LoRA adapters by FedAvg. Every clustering is reported in the aggregate metrics row:
k, the three scikit-learn scores, the score of every k tried, the PCA's explained variance, each client's cluster
and the clusters' task purity.

How the sums travel (``secure``): each cluster is one group. In plaintext any size is fine; under SecAgg+ a cluster
of fewer than ``atlas.min-group-size`` is merged into its nearest cluster by centroid distance (logged, and the
purity of the merged groups reported apart from the clustering's). The server learns the fingerprints, the
clusters and one mean adapter per group, never one client's adapter. The math lives in ``clustering.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.logs import get_logger

from ..base import Arrays, FinalAdapter, Group, GroupResult
from ..fingerprint import FingerprintSection, FingerprintStrategy
from . import plots
from .clustering import (
    LOW_PURITY,
    Clustering,
    choose_clusters,
    fixed_clusters,
    merge_small_clusters,
    oracle_clusters,
    purity,
)
from .config import AtlasSection

if TYPE_CHECKING:
    from common.config import RunConfig

log = get_logger("tessera.server")


class Atlas(FingerprintStrategy):
    """ATLAS: task clusters from gradient fingerprints, FedAvg within each cluster.

    Args:
        cfg: the ``atlas`` section (clustering mode, k, k-max, re-clustering, min group size).
        fingerprint: the ``fingerprint`` section (the PCA dimension).
        secure: cluster means through SecAgg+ (small clusters merged first).
        seed: the run's seed (PCA and k-means).

    State: ``adapter-<partition>`` (the adapter of each client's cluster: it follows the client when clusters
    change), ``groups`` (each partition's group) and ``fingerprint-<partition>``.
    """

    name = "atlas"
    label = "atlas"

    def __init__(self, cfg: AtlasSection, fingerprint: FingerprintSection, secure: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.refresh_every = cfg.recluster_every
        self.dim = fingerprint.dim
        self.secure = secure
        self.seed = seed
        self.clusterings: dict[str, Clustering] = {}
        self.group_labels: dict[str, np.ndarray] = {}  # family -> group of each member (clusters after merges)
        self.merges: dict[str, list[str]] = {}
        self.adapter_of: dict[int, Arrays] = {}  # partition -> its cluster's adapter

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Atlas:
        return cls(cfg.section(AtlasSection), cfg.section(FingerprintSection), cfg.secure, cfg.seed)

    def _cluster(self, family: str) -> Clustering:
        members = self.members[family]
        points = self.reduced[family].points if family in self.reduced else np.zeros((len(members), 1))
        if self.cfg.clustering == "oracle":
            return oracle_clusters(points, [self.reports[p].tasks for p in members])
        if self.cfg.k:
            return fixed_clusters(points, self.cfg.k, self.seed)
        return choose_clusters(points, self.cfg.k_max, self.seed)

    def regroup(self, server_round: int, families: list[str]) -> None:
        for family in families:
            members = self.members[family]
            if not members:
                continue
            clustering = self._cluster(family)
            groups, merges = clustering.labels, list[str]()
            if self.secure:
                groups, merges = merge_small_clusters(clustering.labels, clustering.centroids, self.cfg.min_group_size)
            self.clusterings[family], self.group_labels[family], self.merges[family] = clustering, groups, merges
            tasks = [self.reports[p].tasks for p in members]
            cluster_purity, group_purity = purity(clustering.labels.tolist(), tasks), purity(groups.tolist(), tasks)
            log.info(
                "round %d: atlas clusters of %s: k=%d (scores %s), clusters %s, purity %.2f; groups %s, purity %.2f",
                server_round,
                family,
                clustering.k,
                {k: round(v, 3) for k, v in clustering.scores.items()},
                dict(zip(members, clustering.labels.tolist())),
                cluster_purity,
                dict(zip(members, groups.tolist())),
                group_purity,
            )
            for line in merges:
                log.info("round %d: %s: %s (SecAgg+ needs %d)", server_round, family, line, self.cfg.min_group_size)
            if cluster_purity < LOW_PURITY:
                log.warning(
                    "round %d: low cluster-task purity %.2f (< %.1f) in %s",
                    server_round,
                    cluster_purity,
                    LOW_PURITY,
                    family,
                )

    def _groups(self) -> list[tuple[str, list[int]]]:
        """(name, partitions) of every group: ``<family>-c<label>``."""
        out = []
        for family, labels in sorted(self.group_labels.items()):
            members = self.members[family]
            for label in sorted(set(labels.tolist())):
                out.append((f"{family}-c{label}", [p for p, g in zip(members, labels.tolist()) if g == label]))
        return out

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        node_of = {self.partition_of[nid]: nid for nid in node_ids if nid in self.partition_of}
        groups = []
        for name, partitions in self._groups():
            start = {node_of[p]: self._adapter(p) for p in partitions if p in node_of}
            if start:
                groups.append(Group(name, start))
        placed = {p for _, partitions in self._groups() for p in partitions}
        unplaced = sorted(set(node_of) - placed)
        if unplaced:
            log.warning(
                "round %d: partitions %s have no valid fingerprint: not trained this round", server_round, unplaced
            )
        return groups

    def _adapter(self, partition: int) -> Arrays:
        return self.adapter_of.get(partition, self.initial[self.family_of_partition[partition]])

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        by_name = {r.name: r for r in results}
        for name, partitions in self._groups():
            result = by_name.get(name)
            if result is not None and result.mean is not None:
                for p in partitions:
                    self.adapter_of[p] = result.mean

    def eval_arrays(self, node_id: int) -> Arrays:
        return self._adapter(self.partition_of[node_id])

    def report(self) -> dict[str, Any]:
        out = self.family_report()
        for family, row in out.items():
            clustering = self.clusterings.get(family)
            if clustering is None:
                continue
            groups = self.group_labels[family]
            row.update(
                {
                    "k": clustering.k,
                    "clusters": clustering.labels.tolist(),
                    "groups": groups.tolist(),
                    "silhouette": clustering.silhouette,
                    "davies_bouldin": clustering.davies_bouldin,
                    "calinski_harabasz": clustering.calinski_harabasz,
                    "k_scores": {str(k): v for k, v in clustering.scores.items()},
                    "purity": purity(clustering.labels.tolist(), row["tasks"]),
                    "group_purity": purity(groups.tolist(), row["tasks"]),
                    "merges": self.merges.get(family, []),
                }
            )
        return {"atlas": out}

    def plot_round(self, server_round: int, aggregate_row: dict[str, Any], run_dir: Path) -> list[Path]:
        return plots.fingerprints(server_round, aggregate_row.get("atlas", {}), run_dir / "clusters")

    def plot_run(self, rows: list[dict[str, Any]], run_dir: Path) -> list[Path]:
        return [plots.cluster_loss(rows, run_dir / "cluster-loss.png")]

    # ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Arrays]:
        state = {f"adapter-{pid}": arrays for pid, arrays in sorted(self.adapter_of.items())}
        state.update(self.fingerprint_state())
        return state

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        for key, arrays in state.items():
            if key.startswith("adapter-"):
                self.adapter_of[int(key.removeprefix("adapter-"))] = arrays
        self.load_fingerprint_state(state)

    def final_adapters(self) -> list[FinalAdapter]:
        """One adapter per group (``<family>-c<label>``): what its members were last averaged to."""
        return [
            FinalAdapter(name, self.model_of_family[name.rsplit("-c", 1)[0]], self._adapter(partitions[0]))
            for name, partitions in self._groups()
        ]
