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

Per-layer ranks (``atlas.memory-mb`` or a node's ``memory-mb``): after each clustering every client with a budget
gets ranks from ``atlas.ranks`` per LoRA layer, greedily by its layer importances (``ranks.allocate_ranks``) within
its budget times its cluster's complexity scale. A group's arrays travel at its members' largest rank per layer,
each member's slots zero-padded with a slot mask, and each slot is averaged over the members that have it
(``ranks.slot_average``): a linear rule, so SecAgg+'s sums carry it. The math lives in ``ranks.py``.

MIRA inside the clusters (``atlas.laplacian-eta`` > 0, seed 003 phase 4): every client keeps its own adapter and is
sent the neighbour term N_k = sum_l a_kl W_l over its own cluster (a_kl MIRA's row-normalised RBF adjacency with
a_kl = 0 across clusters), and steps W_k <- (1 - eta) W_k + eta N_k itself. In plaintext every client is its own
group and N_k is exact (the server sees every W_l, as in MIRA); under SecAgg+ each group's mean is the only
neighbour term its members can get (N_k = the group mean, client k included): with eta = 1 that is ATLAS's FedAvg.
With ranks, the masks are mixed with the same weights, so each slot is averaged over the neighbours that have it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.adapters.lora import ranks as lora_ranks
from common.logs import get_logger

from ..aggregation import mix_group_means
from ..base import Arrays, ClientInfo, FinalAdapter, Group, GroupResult, partition_state, read_partition_state
from ..families import family_key
from ..fingerprint import FingerprintReport, FingerprintSection, FingerprintStrategy
from ..fingerprint.laplacian import median_alpha, normalised_adjacency, rbf_adjacency
from ..fingerprint.plots import adjacency as adjacency_plots
from . import plots
from .client import NEIGHBOUR_TERM, OWN_RANKS, WIRE_RANKS, encode_ranks
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
from .ranks import Layer, adapter_mb, allocate_ranks, complexity_scale, mask_problem, slot_mean

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

    State: ``adapter-<partition>`` (the adapter of each client's cluster, or its neighbour term with a Laplacian
    step: it follows the client when clusters change) and ``fingerprint-<partition>`` (the clusters, ranks and
    adjacency are recomputed from these, deterministically).
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
        self.ranks_of: dict[int, dict[str, int]] = {}  # partition -> its LoRA ranks (clients with a budget)
        self.scale_of: dict[int, float] = {}  # partition -> its cluster's complexity scale (of its budget)
        self._slot_fallback: dict[str, Arrays] = {}  # group -> the adapter its never-trained slots keep
        self.clustered_round: dict[str, int] = {}  # family -> the round its clusters were computed in
        self.eta = cfg.laplacian_eta
        self.alpha: dict[str, float] = {}
        self.raw: dict[str, np.ndarray] = {}  # family -> a_kl before the clusters and the normalisation (heatmap)
        self.adjacency: dict[str, np.ndarray] = {}  # family -> row-normalised a_kl inside clusters, ``members`` order

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Atlas:
        return cls(cfg.section(AtlasSection), cfg.section(FingerprintSection), cfg.secure, cfg.seed)

    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        super().initialise(clients)
        if self.cfg.memory_mb:  # the simulation's budgets: a budget that fits no rank is a config error, up front
            for info in clients.values():
                budget = self.cfg.budget(info.partition_id, {})
                try:
                    self._check_budget(family_key(info.model), budget)
                except ValueError as err:
                    raise ValueError(f"atlas.memory-mb: partition {info.partition_id}: {err}") from None

    def layers(self, family: str) -> list[Layer]:
        """The family's LoRA layers (sorted paths) with their widths."""
        initial = self.initial[family]
        return [
            Layer(path, int(initial[a].shape[1]), int(initial[b].shape[0]))
            for path, (a, b) in lora_ranks.layers(initial).items()
        ]

    def _check_budget(self, family: str, budget: float | None) -> None:
        if budget is not None:
            allocate_ranks(self.layers(family), [0.0] * len(self.layers(family)), budget, self.cfg.ranks)

    def read_report(self, arrays: Arrays, metrics: dict[str, Any]) -> FingerprintReport:
        """A valid fingerprint, and a memory budget that fits the smallest rank on every layer of its model."""
        report = super().read_report(arrays, metrics)
        family = family_key(str(metrics.get("model", "")))
        if report.memory_mb is not None and family in self.initial:
            self._check_budget(family, report.memory_mb)
        return report

    def _cluster(self, family: str) -> Clustering:
        members = self.members[family]
        points = self.reduced[family].points if family in self.reduced else np.zeros((len(members), 1))
        if self.cfg.clustering == "oracle":
            return oracle_clusters(points, [self.reports[p].tasks for p in members])
        if self.cfg.k:
            return fixed_clusters(points, self.cfg.k, self.seed)
        return choose_clusters(points, self.cfg.k_max, self.seed, self.cfg.min_cluster_size)

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
            self.clustered_round[family] = server_round
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
            self._allocate(server_round, family, clustering.labels)
            if self.eta:
                points = self.reduced[family].points if family in self.reduced else np.zeros((len(members), 1))
                alpha = self.alpha[family] = self.cfg.alpha_for(median_alpha(points))
                self.raw[family] = rbf_adjacency(points, alpha)
                self.adjacency[family] = normalised_adjacency(points, alpha, clustering.labels.tolist())
            if cluster_purity < LOW_PURITY:
                log.warning(
                    "round %d: low cluster-task purity %.2f (< %.1f) in %s",
                    server_round,
                    cluster_purity,
                    LOW_PURITY,
                    family,
                )

    def _allocate(self, server_round: int, family: str, labels: np.ndarray) -> None:
        """Ranks for every member with a budget: greedy by its layer importances within budget x its cluster's
        complexity scale (seed 003: more heterogeneous, harder clusters get more capacity)."""
        members = self.members[family]
        layers = self.layers(family)
        points = np.stack([self.reports[p].fingerprint for p in members])
        scales = complexity_scale(points, labels)
        for partition, label in zip(members, labels.tolist()):
            report = self.reports[partition]
            if report.memory_mb is None:
                self.ranks_of.pop(partition, None)
                continue
            importance = dict(zip(report.layer_names, report.importance.tolist()))
            scale = scales[int(label)]
            budget = max(report.memory_mb * scale, adapter_mb(layers, [min(self.cfg.ranks)] * len(layers)))
            ranks = allocate_ranks(
                layers, [importance.get(layer.name, 0.0) for layer in layers], budget, self.cfg.ranks
            )
            self.ranks_of[partition] = {layer.name: r for layer, r in zip(layers, ranks)}
            self.scale_of[partition] = scale
            log.info(
                "round %d: partition %d ranks %d..%d (mean %.1f), adapter %.2f MB of %.2f MB (scale %.2f)",
                server_round,
                partition,
                min(ranks),
                max(ranks),
                float(np.mean(ranks)),
                adapter_mb(layers, ranks),
                report.memory_mb,
                scale,
            )

    @property
    def ranked(self) -> bool:
        """Whether any client has its own ranks (then every instruction says each member's and its group's)."""
        return bool(self.ranks_of)

    def _own(self, partition: int) -> dict[str, int]:
        initial = self.initial[self.family_of_partition[partition]]
        return self.ranks_of.get(partition) or lora_ranks.ranks(initial)

    def _wire(self, partition: int) -> dict[str, int]:
        """The ranks ``partition``'s arrays travel at: its group's largest per layer (alone: its own and its
        adapter's)."""
        placed = next((ps for _, ps in self._groups() if partition in ps), None)
        parts = placed or [partition]
        sizes = [self._own(p) for p in parts] + ([] if placed else [lora_ranks.ranks(self._adapter(partition))])
        return {path: max(s[path] for s in sizes) for path in sizes[0]}

    def _outgoing(self, partition: int) -> Arrays:
        """What ``partition`` is sent: its adapter at the wire ranks (fresh slots seeded alike for every client),
        with its slot masks; without ranks, its adapter as it is."""
        adapter = self._adapter(partition)
        if not self.ranked:
            return adapter
        wire = self._wire(partition)
        resized = lora_ranks.seeded_slots(lora_ranks.resize(adapter, wire), lora_ranks.ranks(adapter), self.seed)
        return {**resized, **lora_ranks.masks(self._own(partition), wire)}

    def _rank_config(self, partition: int) -> dict[str, Any]:
        if not self.ranked:
            return {}
        return {OWN_RANKS: encode_ranks(self._own(partition)), WIRE_RANKS: encode_ranks(self._wire(partition))}

    def _groups(self) -> list[tuple[str, list[int]]]:
        """(name, partitions) of every group: ``<family>-c<label>``."""
        out = []
        for family, labels in sorted(self.group_labels.items()):
            members = self.members[family]
            for label in sorted(set(labels.tolist())):
                out.append((f"{family}-c{label}", [p for p, g in zip(members, labels.tolist()) if g == label]))
        return out

    def _units(self) -> list[tuple[str, list[int]]]:
        """(name, partitions) of what trains as one group: the groups, or with a Laplacian step in plaintext every
        client alone (``p<partition>``), so that the server has every W_l for the exact neighbour terms."""
        if self.eta and not self.secure:
            return [(f"p{p}", [p]) for _, partitions in self._groups() for p in partitions]
        return self._groups()

    def _config(self, partition: int) -> dict[str, Any]:
        config = self._rank_config(partition)
        if self.eta and partition in self.adapter_of:
            config[NEIGHBOUR_TERM] = True
        return config

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        node_of = {self.partition_of[nid]: nid for nid in node_ids if nid in self.partition_of}
        groups = []
        for name, partitions in self._units():
            start = {node_of[p]: self._outgoing(p) for p in partitions if p in node_of}
            if start:
                configs = {node_of[p]: self._config(p) for p in partitions if p in node_of}
                self._slot_fallback[name] = lora_ranks.without_masks(next(iter(start.values())))
                groups.append(Group(name, start, member_configs=configs))
        placed = {p for _, partitions in self._groups() for p in partitions}
        unplaced = sorted(set(node_of) - placed)
        if unplaced:
            log.warning(
                "round %d: partitions %s have no valid fingerprint: not trained this round", server_round, unplaced
            )
        return groups

    def _adapter(self, partition: int) -> Arrays:
        return self.adapter_of.get(partition, self.initial[self.family_of_partition[partition]])

    def check_sum(self, result: GroupResult) -> str | None:
        """With per-client ranks, the group's mean rank masks must be ones its members can send
        (``ranks.mask_problem``): ``slot_mean`` divides by them."""
        if result.mean is None or not self.ranked:
            return None
        weights = [float(result.metrics.get(n, {}).get("num_examples", 0)) for n in result.contributors]
        problem = mask_problem(result.mean, weights)
        return f"atlas ranks: {problem}" if problem else None

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        by_name = {r.name: r.mean for r in results if r.mean is not None}
        if self.eta:
            self._neighbour_terms(by_name)
            return
        for name, partitions in self._groups():
            if name in by_name:
                for p in partitions:
                    self.adapter_of[p] = self._finish(by_name[name], name)

    def _finish(self, mean: Arrays, unit: str) -> Arrays:
        return slot_mean(mean, self._slot_fallback.get(unit)) if self.ranked else mean

    def _neighbour_terms(self, means: dict[str, Arrays]) -> None:
        """N_k = sum_l a_kl W_l over k's cluster, mixed from the means of the units inside k's group (one shape:
        the group's wire ranks; exact when every client is its own unit); a client none of whose neighbours
        trained gets its own unit's mean (no pull)."""
        units = self._units()
        for _, partitions in self._groups():
            family = self.family_of_partition[partitions[0]]
            rows = [self.members[family].index(p) for p in partitions]
            local = {p: i for i, p in enumerate(partitions)}
            inside = [(name, ps) for name, ps in units if ps[0] in local]
            mixed = mix_group_means(
                self.adjacency[family][np.ix_(rows, rows)],
                [[local[p] for p in ps] for _, ps in inside],
                [means.get(name) for name, _ in inside],
            )
            for unit, ps in inside:
                for p in ps:
                    term: Arrays | None = mixed[local[p]]
                    if not set(self.initial[family]) <= set(term or {}):
                        term = means.get(unit)
                    if term is not None:
                        self.adapter_of[p] = self._finish(term, unit)

    def eval_arrays(self, node_id: int) -> Arrays:
        return self._outgoing(self.partition_of[node_id])

    def eval_config(self, node_id: int) -> dict[str, Any]:
        return self._config(self.partition_of[node_id])

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
                    "clustered_round": self.clustered_round.get(family),
                }
            )
            if family in self.adjacency:
                row["laplacian_eta"] = self.eta
                row["alpha"] = self.alpha[family]
                row["adjacency_raw"] = self.raw[family].round(6).tolist()
                row["adjacency"] = self.adjacency[family].round(6).tolist()
            layers = self.layers(family)
            ranked = [p for p in row["partitions"] if p in self.ranks_of]
            if ranked:
                row["layers"] = [layer.name for layer in layers]
                row["ranks"] = {str(p): [self.ranks_of[p][layer.name] for layer in layers] for p in ranked}
                row["adapter_mb"] = {str(p): adapter_mb(layers, row["ranks"][str(p)]) for p in ranked}
                row["budget_mb"] = {str(p): self.reports[p].memory_mb for p in ranked}
                row["budget_scale"] = {str(p): self.scale_of[p] for p in ranked}
        return {"atlas": out}

    def plot_round(self, server_round: int, aggregate_row: dict[str, Any], run_dir: Path) -> list[Path]:
        families = aggregate_row.get("atlas", {})
        return [
            *plots.fingerprints(server_round, families, run_dir / "clusters"),
            *plots.rank_allocation(server_round, families, run_dir / "ranks"),
            *adjacency_plots(server_round, plots.by_cluster(families), run_dir / "adjacency"),
        ]

    def plot_run(self, rows: list[dict[str, Any]], run_dir: Path) -> list[Path]:
        return [plots.cluster_loss(rows, run_dir / "cluster-loss.png")]

    # ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Arrays]:
        return {**partition_state("adapter-", self.adapter_of), **self.fingerprint_state()}

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        self.adapter_of.update(read_partition_state(state, "adapter-"))
        self.load_fingerprint_state(state)

    def final_adapters(self) -> list[FinalAdapter]:
        """One adapter per group (``<family>-c<label>``): what its members were last averaged to; none with a
        Laplacian step (every client saves its own, ``client-adapters/partition-<id>``)."""
        if self.eta:
            return []
        return [
            FinalAdapter(name, self.model_of_family[name.rsplit("-c", 1)[0]], self._adapter(partitions[0]))
            for name, partitions in self._groups()
        ]
