"""VEMoE's server half: one group of every client, whose sum gives every expert of the pool, and the open-world
decisions taken from that sum alone (seed 002; the math is ``pool.py``).

Each round every client is sent the whole pool (``expert-<slot>.*`` for every slot), the live slots
(``responsibility``: 1 for a live slot, 0 for a free one) and the slot reserved for a birth (instruction config
``vemoe-birth-slot``, -1 when the pool is full). It replies with the constant-length payload of ``pool.py``; all
replies are one group (SecAgg+ in secure mode: at least 3 members), weighted equally, so the group mean times the
number of contributors is the sum. From it: theta_k = sum r theta / sum r per slot, then prune (little
responsibility for ``prune-patience`` rounds), merge (near-duplicate delta-W), birth (``birth-min-votes`` voters'
candidates averaged into the reserved slot); never more than K_max experts. Every event goes into the round's
aggregate metrics row (``vemoe.events``) and the log.

What the server learns: in plain mode every client's payload (its responsibility vector, the experts it trained
weighted by them, and whether it voted); in secure mode only their sum: each expert's total responsibility and
responsibility-weighted aggregate, and the number of votes with the mean candidate, never which client uses which
expert or voted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.adapters.experts import ExpertsSection
from common.adapters.experts.adapter import join_slots, split_slots
from common.config import resolve_run_dir
from common.logs import get_logger
from common.plots import negative_transfer, worst_client

from ..base import WEIGHT_EQUALLY, Arrays, ClientInfo, FinalAdapter, Group, GroupResult, Strategy
from . import plots
from .config import VemoeSection
from .pool import experts_from_sum, free_slot, functional_distance, merge, merge_pairs, newborn, prune, sum_problem
from .separation import separation
from .wire import BESIDE_POOL, GAP, MOVE, REPLY_METRICS, VOTE, VemoeWire, beside_pool

if TYPE_CHECKING:
    from common.config import RunConfig

log = get_logger("tessera.server")
LIVE, LOW_ROUNDS = "live", "low-rounds"  # state keys beside the pool's experts


class VEMoE(Strategy):
    """A pool of LoRA experts aggregated by responsibility from one sum per round, with birth, prune and merge.

    State: ``pool`` (every slot's expert, wire names), ``live`` and ``low-rounds`` (per slot).
    """

    name = "vemoe"
    # plain mode only: each slot's probe loss (-1: free) and responsibility, the routed slots, the birth vote
    reply_metrics = REPLY_METRICS

    def __init__(self, pool: ExpertsSection, cfg: VemoeSection) -> None:
        self.pool_cfg, self.cfg = pool, cfg
        self.experts: list[Arrays] = []
        self.live = np.zeros(pool.k_max, dtype=bool)
        self.live[: cfg.k_init] = True
        self.low_rounds = np.zeros(pool.k_max, dtype=np.int64)
        self.model = ""
        self.members: set[int] = set()
        self.events: list[dict[str, Any]] = []
        self.totals = np.zeros(pool.k_max)
        self.distance = np.full((pool.k_max, pool.k_max), np.nan)  # last round's functional distances (reported)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> VEMoE:
        return cls(cfg.section(ExpertsSection), cfg.section(VemoeSection))

    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        for nid, info in sorted(clients.items()):
            experts = split_slots(info.initial, self.pool_cfg.k_max)
            if not self.experts:
                self.experts, self.model = experts, info.model
            elif _shapes(experts[0]) != _shapes(self.experts[0]):
                raise ValueError(
                    f"vemoe: node {nid} ({info.model}) has experts of other shapes than {self.model}'s: one pool "
                    "needs one base model"
                )
            self.members.add(nid)

    def _start(self) -> Arrays:
        return {**join_slots(self.experts), **beside_pool(self.pool_cfg.k_max, self.live)}

    def _free_slot(self) -> int:
        """The slot a birth would take this round (the lowest free one), -1 when the pool is full."""
        slot = free_slot(self.live)
        return -1 if slot is None else slot

    def _prior(self) -> tuple[float, ...] | None:
        """With ``likelihood = "summed"``: each live slot's share of last round's responsibility, counted with one
        pseudo-client per slot (so that no live expert's prior is 0, a newborn's included); 0 on free slots."""
        if self.cfg.likelihood != "summed":
            return None
        counts = np.where(self.live, self.totals + 1.0, 0.0)
        return tuple(float(x) for x in counts / counts.sum())

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        start = self._start()
        members = {nid: start for nid in node_ids if nid in self.members}
        if not members:
            return []
        return [
            Group(
                "pool",
                members,
                config=VemoeWire(birth_slot=self._free_slot(), prior=self._prior()),
                weight_by=WEIGHT_EQUALLY,
                max_weight=1.0,
            )
        ]

    def check_sum(self, result: GroupResult) -> str | None:
        """The pool's sum must be one honest members can send (``pool.sum_problem``): the server divides by its
        slot totals and votes."""
        if result.mean is None or not result.contributors:
            return None
        n = len(result.contributors)
        total = {k: np.asarray(result.mean[k], dtype=np.float64) * n for k in BESIDE_POOL}
        problem = sum_problem(total, n, self.live)
        return f"vemoe: {problem}" if problem else None

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        self.events = []
        for result in results:
            if result.mean is None or not result.contributors:
                continue
            n = len(result.contributors)
            total = {k: np.asarray(v, dtype=np.float64) * n for k, v in result.mean.items()}
            reserved = self._free_slot()
            self.experts, self.totals = experts_from_sum(total, self.experts)
            self._prune(server_round)
            self.distance = functional_distance(total[GAP], total[MOVE])  # on the probes of the pool sent this round
            self._merge(server_round)
            votes = float(total[VOTE][0])
            if reserved >= 0 and votes >= self.cfg.birth_min_votes:  # prune and merge only free slots: still free
                self.experts[reserved] = newborn(total, votes, reserved, self.experts[reserved])
                self.live[reserved] = True
                self._event(server_round, "birth", reserved, votes=votes)
            elif votes:
                log.info("round %d: vemoe: %g birth votes, %d needed", server_round, votes, self.cfg.birth_min_votes)

    def _prune(self, server_round: int) -> None:
        mass = max(float(self.totals[self.live].sum()), 1e-12)
        self.live, self.low_rounds, pruned = prune(
            self.totals, self.live, self.low_rounds, self.cfg.prune_threshold, self.cfg.prune_patience
        )
        for slot in pruned:
            self._event(server_round, "prune", slot, share=float(self.totals[slot] / mass))

    def _merge(self, server_round: int) -> None:
        """Merge near-duplicates: by delta-W cosine, or by the functional distance on this round's probes (measured
        on the pool the clients received, i.e. before this round's update)."""
        cfg = self.cfg
        pairs = merge_pairs(self.experts, self.live, cfg.merge_threshold, self.distance, cfg.merge_distance)
        for kept, merged, measures in pairs:
            self.experts[kept] = merge(
                self.experts[kept], self.experts[merged], float(self.totals[kept]), float(self.totals[merged])
            )
            self.live[merged] = False
            self.low_rounds[merged] = 0
            self._event(server_round, "merge", merged, into=kept, **measures)

    def _event(self, server_round: int, kind: str, slot: int, **numbers: Any) -> None:
        event = {"round": server_round, "kind": kind, "slot": slot, **numbers}
        self.events.append(event)
        log.info("round %d: vemoe %s of slot %d: %s", server_round, kind, slot, numbers)

    def report(self) -> dict[str, Any]:
        return {
            "vemoe": {
                "live": self.live.astype(int).tolist(),
                "responsibility": self.totals.round(6).tolist(),
                "low_rounds": self.low_rounds.tolist(),  # rounds in a row below vemoe.prune-threshold
                # each pair of live slots' functional distance on this round's probes (pool.functional_distance)
                "distance": {
                    f"{a},{b}": round(float(self.distance[a, b]), 4)
                    for a in range(len(self.live))
                    for b in range(a + 1, len(self.live))
                    if np.isfinite(self.distance[a, b])
                },
                "experts": int(self.live.sum()),
                "events": self.events,
            }
        }

    def eval_arrays(self, node_id: int) -> Arrays:
        return self._start()

    def plot_run(self, rows: list[dict[str, Any]], run_dir: Path) -> list[Path]:
        """expert_utilization.png, worst_client.png, vemoe_separation.json (plain mode: how purely each round's top-1
        experts follow the clients' task sets) and, against ``vemoe.baseline-run``, negative_transfer.png."""
        paths = [plots.expert_utilization(rows, run_dir / "expert_utilization.png")]
        if measured := separation(rows):
            (run_dir / "vemoe_separation.json").write_text(json.dumps(measured, indent=1))
            paths.append(run_dir / "vemoe_separation.json")
            log.info("vemoe: top-1 expert purity by round: %s", {m["round"]: round(m["purity"], 3) for m in measured})
        paths.append(worst_client(rows, run_dir / "worst_client.png"))
        baseline = resolve_run_dir(self.cfg.baseline_run) / "metrics.jsonl" if self.cfg.baseline_run else None
        if baseline is None or not baseline.exists():
            log.info(
                "vemoe: negative_transfer.png skipped: %s",
                "no vemoe.baseline-run" if baseline is None else f"{baseline} does not exist",
            )
            return paths
        base_rows = [json.loads(line) for line in baseline.read_text().splitlines() if line.strip()]
        paths.append(negative_transfer(rows, base_rows, run_dir / "negative_transfer.png"))
        return paths

    def state_dict(self) -> dict[str, Arrays]:
        return {
            "pool": join_slots(self.experts),
            "slots": {LIVE: self.live.astype(np.int64), LOW_ROUNDS: self.low_rounds.copy()},
        }

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        self.experts = split_slots(state["pool"], self.pool_cfg.k_max)
        self.live = np.asarray(state["slots"][LIVE]).astype(bool)
        self.low_rounds = np.asarray(state["slots"][LOW_ROUNDS]).astype(np.int64)

    def final_adapters(self) -> list[FinalAdapter]:
        """The pool (saved as one PEFT LoRA per trained expert, ``adapter/expert-<slot>/``)."""
        return [FinalAdapter("", self.model, join_slots(self.experts))]


def _shapes(arrays: Arrays) -> dict[str, tuple[int, ...]]:
    return {k: np.shape(v) for k, v in arrays.items()}
