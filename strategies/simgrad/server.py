"""SimGrad (FedMosaic): relevance-weighted, personalised aggregation of PQ-LoRA across heterogeneous clients.

Every round each client reports a sanitised gradient signature of a shared frozen probe and the salience of its
adapter blocks. The server builds the cosine relevance matrix S, the row softmax W = softmax(S / tau), and gives
every client i its own global adapter P_G_i = sum_j W_ij P_L_j (likewise Q). P and Q are r x r and r numbers per
projection, independent of the base model's width, so clients with different base models mix them.

How the sums travel (``secure``):
- plain: every client is its own group, so the server sees each P_L_j and the mix is exact;
- secure: clients are grouped by their relevance rows (groups of at least ``min-group-size``), each group's mean
  goes through SecAgg+, and client i gets sum_g (sum_{j in g} W_ij) mean_g. The server learns the signatures, S,
  W and one mean per group, never an individual P/Q. The two agree exactly when W is constant inside groups.
Layerwise routing: each group trains and sends only its ``route-budget`` most salient blocks; the other blocks'
global parts are kept. The math lives in ``relevance.py`` beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.logs import get_logger

from ..aggregation import group_by_relevance, mix_group_means, personalised_mix
from ..base import Arrays, ClientInfo, FinalAdapter, Group, GroupResult, Strategy, partition_state, read_partition_state
from ..sketches import report_vector
from . import plots
from .config import SimGradSection
from .relevance import cosine_relevance, relevance_weights, route_blocks
from .wire import ALIGN_ERROR_AFTER, ALIGN_ERROR_BEFORE, SALIENCE, SIGNATURE, SimGradWire

if TYPE_CHECKING:
    from common.config import RunConfig

log = get_logger("tessera.server")


# Signatures are per-token mean gradient sketches (|x| far below 1e6); a client's must stay within these bounds.
MAX_SIGNATURE_SIZE = 1 << 20
MAX_SIGNATURE_ABS = 1e6


@dataclass
class ClientReport:
    """A client's per-round report: its sanitised signature and the salience of each adapter block."""

    signature: np.ndarray
    salience: np.ndarray


def block_of(name: str) -> int:
    """``block3.q_proj.P`` -> 3."""
    return int(name.split(".", 1)[0].removeprefix("block"))


class SimGrad(Strategy):
    """Personalised PQ-LoRA aggregation by gradient-signature relevance (plain: exact; secure: group sums).

    Args:
        cfg: the ``simgrad`` config section (temperature, mixing, route budget, min group size).
        secure: whether group means go through SecAgg+ (then groups have at least ``cfg.min_group_size`` members).

    State: ``client-<partition id>`` — each client's personalised global P/Q.
    """

    name = "simgrad"
    wants_reports = True
    reply_metrics = {ALIGN_ERROR_BEFORE: None, ALIGN_ERROR_AFTER: None}

    def __init__(self, cfg: SimGradSection, secure: bool = False) -> None:
        self.cfg = cfg
        self.secure = secure
        self.partition_of: dict[int, int] = {}
        self.model_of: dict[int, str] = {}
        self.model_of_partition: dict[int, str] = {}
        self.global_by_partition: dict[int, Arrays] = {}
        self.names: list[str] = []
        self._shapes: dict[str, tuple] = {}  # the P/Q names and shapes every client must have
        self.nodes: list[int] = []  # this round's clients with a valid report, in matrix order
        self.scores = np.zeros((0, 0))
        self.weights = np.zeros((0, 0))
        self.groups: list[list[int]] = []  # indices into self.nodes
        self.active: list[list[int]] = []  # per group: the blocks trained and sent

    @classmethod
    def from_config(cls, cfg: RunConfig) -> SimGrad:
        return cls(cfg.section(SimGradSection), secure=cfg.secure)

    # ------------------------------------------------------------------------------------------------------
    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        shapes = {nid: {k: v.shape for k, v in info.initial.items()} for nid, info in clients.items()}
        reference = self._shapes or next(iter(shapes.values()))
        for nid, shape in shapes.items():
            if shape != reference:  # P/Q must not depend on the model; different shapes mean different pqlora settings
                raise ValueError(
                    f"simgrad: node {nid}'s PQ-LoRA arrays differ from the others' ({clients[nid].model}); "
                    "use one pqlora config"
                )
        for nid, info in clients.items():
            self.partition_of[nid] = info.partition_id
            self.model_of[nid] = info.model
            self.model_of_partition[info.partition_id] = info.model
            self.global_by_partition.setdefault(info.partition_id, {k: v.copy() for k, v in info.initial.items()})
        self._shapes = reference
        self.names = sorted(reference)

    def read_report(self, arrays: Arrays, metrics: dict[str, Any]) -> ClientReport:
        """A finite, non-zero 1-D signature and one finite, non-negative salience per adapter block."""
        signature = report_vector(arrays, SIGNATURE, MAX_SIGNATURE_SIZE, MAX_SIGNATURE_ABS)
        if not np.any(signature):
            raise ValueError("signature is all zeros (cosine relevance undefined)")
        num_blocks = len({block_of(k) for k in self.names})
        try:
            salience = np.asarray(metrics.get(SALIENCE, []), dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"salience must be numbers, got {metrics.get(SALIENCE)!r}") from None
        if salience.shape != (num_blocks,) or not np.all(np.isfinite(salience)) or np.any(salience < 0):
            raise ValueError(f"salience must be {num_blocks} finite non-negative numbers, got {salience.tolist()}")
        return ClientReport(signature.astype(np.float32), salience)

    def observe_reports(self, server_round: int, reports: dict[int, ClientReport]) -> dict[int, str]:
        # Signatures are comparable only with the same probe and sketch: the length most clients sent wins.
        left_out: dict[int, str] = {}
        lengths = [r.signature.size for r in reports.values()]
        if lengths:
            common = max(set(lengths), key=lengths.count)
            for nid, report in reports.items():
                if report.signature.size != common:
                    left_out[nid] = (
                        f"signature has {report.signature.size} numbers, the others {common} (another probe?)"
                    )
        reports = {nid: r for nid, r in reports.items() if nid not in left_out}
        self._relevance(server_round, reports)
        return left_out

    def _relevance(self, server_round: int, reports: dict[int, ClientReport]) -> None:
        # matrix order = partition order, so heatmaps and metrics read the same across runs (node ids are random)
        self.nodes = sorted(
            (nid for nid in reports if nid in self.partition_of), key=lambda nid: self.partition_of[nid]
        )
        if not self.nodes:
            self.scores = self.weights = np.zeros((0, 0))
            self.groups, self.active = [], []
            return
        signatures = np.stack([reports[nid].signature for nid in self.nodes]).astype(np.float64)
        self.scores = cosine_relevance(signatures)
        self.weights = relevance_weights(signatures, self.cfg.temperature, self.cfg.mixing, self.cfg.mix_self)
        n = len(self.nodes)
        if self.secure:
            self.groups = group_by_relevance(self.scores, self.cfg.min_group_size)
        else:
            self.groups = [[i] for i in range(n)]
        salience = np.stack([np.asarray(reports[nid].salience, dtype=np.float64) for nid in self.nodes])
        # each member's salience as shares of its own total: one member's say in its group's blocks is bounded (a
        # salience of 1e300 chose the group's blocks alone)
        totals = salience.sum(axis=1, keepdims=True)
        shares = np.divide(salience, totals, out=np.zeros_like(salience), where=totals > 0)
        budget = self.cfg.route_budget
        self.active = [route_blocks(shares[g].sum(axis=0), budget) for g in self.groups]
        log.info(
            "round %d: relevance over %d clients; groups %s; active blocks %s",
            server_round,
            n,
            [[self.nodes[i] for i in g] for g in self.groups],
            self.active,
        )

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        present = set(node_ids)
        groups = []
        for index, (members, blocks) in enumerate(zip(self.groups, self.active)):
            nodes = [self.nodes[i] for i in members if self.nodes[i] in present]
            send_back = [k for k in self.names if block_of(k) in blocks]
            start = {nid: self.global_by_partition[self.partition_of[nid]] for nid in nodes}
            groups.append(Group(self._group_name(index), start, send_back, SimGradWire(active_blocks=tuple(blocks))))
        return [g for g in groups if g.start]

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        if not self.nodes:
            return
        by_name = {r.name: r for r in results}
        names = [self._group_name(i) for i in range(len(self.groups))]
        means = [by_name[name].mean if name in by_name else None for name in names]
        if self.secure:
            mixed = mix_group_means(self.weights, self.groups, means)
        else:
            mixed = personalised_mix(self.weights, [mean if mean is not None else {} for mean in means])
        for i, nid in enumerate(self.nodes):
            previous = self.global_by_partition[self.partition_of[nid]]
            # Blocks nobody trained this round (routing, or every reply rejected) keep their previous global part.
            self.global_by_partition[self.partition_of[nid]] = {
                k: mixed[i].get(k, previous[k]).astype(np.float32) for k in self.names
            }

    def _group_name(self, index: int) -> str:
        if self.secure:
            return f"g{index}"
        return f"p{self.partition_of[self.nodes[self.groups[index][0]]]}"

    def eval_arrays(self, node_id: int) -> Arrays:
        return self.global_by_partition[self.partition_of[node_id]]

    def report(self) -> dict[str, Any]:
        return {
            "relevance_nodes": self.nodes,
            "relevance_partitions": [self.partition_of[n] for n in self.nodes],
            "relevance_models": [self.model_of[n] for n in self.nodes],
            "relevance": self.scores.round(6).tolist(),
            "relevance_weights": self.weights.round(6).tolist(),
            "groups": [[self.nodes[i] for i in g] for g in self.groups],
            "active_blocks": self.active,
        }

    # ------------------------------------------------------------------------------------------------------
    def plot_round(self, server_round: int, aggregate_row: dict[str, Any], run_dir: Path) -> list[Path]:
        if not aggregate_row.get("relevance"):
            return []
        return [plots.relevance(server_round, aggregate_row, run_dir / "relevance" / f"round-{server_round:03d}.png")]

    def plot_run(self, rows: list[dict[str, Any]], run_dir: Path) -> list[Path]:
        return [plots.gates(rows, run_dir / "gates.png")]

    # ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Arrays]:
        return partition_state("client-", self.global_by_partition)

    def final_adapters(self) -> list[FinalAdapter]:
        """Each client's global P/Q (a client saves its full adapter itself: its local parts never leave it)."""
        return [
            FinalAdapter(f"client-{pid}", self.model_of_partition.get(pid, ""), arrays)
            for pid, arrays in sorted(self.global_by_partition.items())
        ]

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        self.global_by_partition.update(read_partition_state(state, "client-"))
