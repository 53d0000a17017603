"""MIRA's server half: the RBF adjacency of the clients' fingerprints and the neighbour term of the Laplacian step.

Every client keeps its own LoRA W_k (client state). Each round it trains W_k locally and sends it; the server
returns the neighbour term N_k = sum_l a_kl W_l, and the client finishes the step itself:
W_k <- (1 - eta) W_k + eta N_k, which equals W_k - eta sum_l a_kl (W_k - W_l) because the rows of a sum to 1.

How the sums travel (``secure``):
- plain: every client is its own group: the server sees every W_l and N_k is exact;
- secure: clients are grouped by the adjacency (groups of at least ``mira.min-group-size``, within a base model),
  each group's plain mean goes through SecAgg+, and N_k = sum_g (sum_{l in g} a_kl) mean_g / sum_g (...). The
  server learns the fingerprints, the adjacency and one mean per group, never one client's adapter. The secure N_k
  differs from the exact one because a group's mean includes client k itself (a_kk = 0 in the exact one) and spreads
  a_kl evenly inside each group.
The math lives in ``strategies.fingerprint.laplacian`` (shared with ATLAS's in-cluster step) and
``strategies.aggregation`` (grouping and mixing group means).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.logs import get_logger

from ..aggregation import group_by_relevance, mix_group_means
from ..base import WEIGHT_EQUALLY, Arrays, FinalAdapter, Group, GroupResult, partition_state, read_partition_state
from ..fingerprint import FingerprintSection, FingerprintStrategy, plots
from ..fingerprint.laplacian import median_alpha, normalised_adjacency, rbf_adjacency
from .config import MiraSection

if TYPE_CHECKING:
    from common.config import RunConfig

log = get_logger("tessera.server")


class Mira(FingerprintStrategy):
    """MIRA: personal LoRA adapters pulled toward their fingerprint neighbours by a graph-Laplacian step.

    Args:
        cfg: the ``mira`` section (alpha, eta, refresh, min group size).
        fingerprint: the ``fingerprint`` section (the PCA dimension the adjacency is computed in).
        secure: group means through SecAgg+ (groups of at least ``cfg.min_group_size``).
        seed: the run's seed (PCA).

    State: ``neighbours-<partition>`` (each client's last neighbour term) and ``fingerprint-<partition>``.
    """

    name = "mira"
    label = "mira"

    def __init__(self, cfg: MiraSection, fingerprint: FingerprintSection, secure: bool = False, seed: int = 0) -> None:
        super().__init__(cfg.refresh_every, fingerprint, secure, seed)
        self.cfg = cfg
        self.alpha: dict[str, float] = {}
        self.raw: dict[str, np.ndarray] = {}  # family -> a_kl before normalisation (for the heatmap)
        self.adjacency: dict[str, np.ndarray] = {}  # family -> row-normalised a_kl, in ``members`` order
        self.groups: dict[str, list[list[int]]] = {}  # family -> groups of indices into ``members``
        self.neighbours: dict[int, Arrays] = {}  # partition -> N_k

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Mira:
        return cls(cfg.section(MiraSection), cfg.section(FingerprintSection), cfg.secure, cfg.seed)

    def regroup(self, server_round: int, families: list[str]) -> None:
        for family in families:
            members = self.members[family]
            points = self.reduced[family].points if family in self.reduced else np.zeros((len(members), 1))
            alpha = self.cfg.alpha_for(median_alpha(points))
            self.alpha[family] = alpha
            self.raw[family] = rbf_adjacency(points, alpha)
            self.adjacency[family] = normalised_adjacency(points, alpha)
            n = len(members)
            self.groups[family] = (
                group_by_relevance(self.adjacency[family], self.cfg.min_group_size)
                if self.secure
                else [[i] for i in range(n)]
            )
            log.info(
                "round %d: mira adjacency over partitions %s (%s, alpha %.3g); groups %s",
                server_round,
                members,
                family,
                alpha,
                [[members[i] for i in g] for g in self.groups[family]],
            )

    def _group_name(self, family: str, index: int) -> str:
        members = self.members[family]
        if self.secure:
            return f"{family}-g{index}"
        return f"p{members[self.groups[family][index][0]]}"

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        node_of = {self.partition_of[nid]: nid for nid in node_ids if nid in self.partition_of}
        groups = []
        for family, members in sorted(self.members.items()):
            for index, group in enumerate(self.groups.get(family, [])):
                start = {
                    node_of[members[i]]: self.neighbours.get(members[i], self.initial[family])
                    for i in group
                    if members[i] in node_of
                }
                if start:
                    groups.append(Group(self._group_name(family, index), start, weight_by=WEIGHT_EQUALLY))
        unplaced = sorted(set(node_of) - {p for members in self.members.values() for p in members})
        if unplaced:
            log.warning(
                "round %d: partitions %s have no valid fingerprint: not trained this round", server_round, unplaced
            )
        return groups

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        by_name = {r.name: r for r in results}
        for family, members in sorted(self.members.items()):
            groups = self.groups.get(family, [])
            means = [
                by_name[name].mean if name in by_name else None
                for name in (self._group_name(family, i) for i in range(len(groups)))
            ]
            mixed = mix_group_means(self.adjacency[family], groups, means)
            names = set(self.initial[family])
            for i, pid in enumerate(members):
                if set(mixed[i]) == names:  # a client whose neighbours all failed keeps its previous term
                    self.neighbours[pid] = mixed[i]

    def eval_arrays(self, node_id: int) -> Arrays:
        pid = self.partition_of[node_id]
        return self.neighbours.get(pid, self.initial[self.family_of_partition[pid]])

    def report(self) -> dict[str, Any]:
        out = self.family_report()
        for family, row in out.items():
            row.update(
                {
                    "alpha": self.alpha.get(family),
                    "adjacency_raw": self.raw[family].round(6).tolist() if family in self.raw else [],
                    "adjacency": self.adjacency[family].round(6).tolist() if family in self.adjacency else [],
                    "groups": [[self.members[family][i] for i in g] for g in self.groups.get(family, [])],
                }
            )
        return {"mira": out}

    def plot_round(self, server_round: int, aggregate_row: dict[str, Any], run_dir: Path) -> list[Path]:
        return plots.adjacency(server_round, aggregate_row.get("mira", {}), run_dir / "adjacency")

    # ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Arrays]:
        return {**partition_state("neighbours-", self.neighbours), **self.fingerprint_state()}

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        self.neighbours.update(read_partition_state(state, "neighbours-"))
        self.load_fingerprint_state(state)

    def final_adapters(self) -> list[FinalAdapter]:
        """None on the server: every client saves its own adapter (``client-adapters/partition-<id>``)."""
        return []
