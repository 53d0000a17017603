"""The server half shared by ATLAS and MIRA: reading fingerprint reports, keeping the newest per client, and the
PCA of each base-model family's fingerprints.

Fingerprints of different base models are never compared (their adapters differ in shape and their gradients in
meaning): every computation here is per family (``strategies.fedavg.family_key``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from common.logs import get_logger
from common.messages import split

from ..base import MIN_SECURE_GROUP, Arrays, ClientInfo, Strategy
from ..families import family_key
from ..sketches import report_vector
from .config import FingerprintSection
from .pca import LOW_EXPLAINED_VARIANCE, Reduced, reduce_fingerprints
from .wire import FINGERPRINT, LAYER_IMPORTANCE, LAYER_NAMES

log = get_logger("tessera.server")

MAX_FINGERPRINT_SIZE = 1 << 16
MAX_FINGERPRINT_ABS = 1e6
MEMORY_MB = "memory_mb"  # report metric: the client's memory budget for its adapter (ATLAS's client sends one)


@dataclass
class FingerprintReport:
    """A client's report: its fingerprint, the gradient norm of each adapted layer, its task names."""

    fingerprint: np.ndarray
    layer_names: list[str]
    importance: np.ndarray
    tasks: str
    memory_mb: float | None = None  # the client's memory budget for its adapter (ATLAS's rank allocation)


def read_fingerprint(arrays: Arrays, metrics: dict[str, Any]) -> FingerprintReport:
    """A finite 1-D fingerprint within bounds and one finite, non-negative importance per named layer."""
    fingerprint = report_vector(arrays, FINGERPRINT, MAX_FINGERPRINT_SIZE, MAX_FINGERPRINT_ABS).astype(np.float64)
    names = [str(n) for n in split(metrics.get(LAYER_NAMES), str)]
    try:
        importance = np.asarray(split(metrics.get(LAYER_IMPORTANCE)), dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"layer_importance must be numbers, got {metrics.get(LAYER_IMPORTANCE)!r}") from None
    if not names or importance.shape != (len(names),):
        raise ValueError(f"layer_importance must give one number for each of the {len(names)} layer_names")
    if not np.all(np.isfinite(importance)) or np.any(importance < 0):
        raise ValueError("layer_importance must be finite and non-negative")
    budget = metrics.get(MEMORY_MB)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
        raise ValueError(f"memory_mb must be a positive number, got {budget!r}")
    memory = None if budget is None else float(budget)
    return FingerprintReport(fingerprint, names, importance, str(metrics.get("tasks", "")), memory)


class FingerprintStrategy(Strategy):
    """Bookkeeping for a strategy whose server half asks clients for task fingerprints.

    Subclasses pass ``refresh_every`` (0: fingerprints once, in round 1), the fingerprint section, ``secure`` and
    the run's seed to ``__init__``, and implement ``regroup``, called after every round whose reports arrived, with
    the families whose fingerprints changed.

    Attributes:
        partition_of, model_of: per node id, its partition id and base model.
        family_of_partition: per partition id, its model family.
        initial: per family, the initial adapter (what every client of it starts from).
        reports: per partition id, its newest valid fingerprint report.
        reduced: per family, the PCA of its clients' fingerprints (in ``family_members`` order).
    """

    wants_reports = True
    refresh_every: int = 0
    dim: int = 64
    seed: int = 0
    secure: bool = False
    label: ClassVar[str] = "fingerprint"

    def __init__(
        self, refresh_every: int = 0, fingerprint: FingerprintSection | None = None, secure: bool = False, seed: int = 0
    ) -> None:
        self.refresh_every = refresh_every
        self.dim = (fingerprint or FingerprintSection()).dim
        self.secure = secure
        self.seed = seed
        self.partition_of: dict[int, int] = {}
        self.model_of: dict[int, str] = {}
        self.family_of_partition: dict[int, str] = {}
        self.model_of_family: dict[str, str] = {}
        self.initial: dict[str, Arrays] = {}
        self.reports: dict[int, FingerprintReport] = {}
        self.reduced: dict[str, Reduced] = {}
        self.members: dict[str, list[int]] = {}  # family -> partition ids with a fingerprint, sorted

    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        for nid, info in sorted(clients.items()):
            family = family_key(info.model)
            if family in self.initial and {k: v.shape for k, v in info.initial.items()} != {
                k: v.shape for k, v in self.initial[family].items()
            }:
                raise ValueError(f"{self.name}: node {nid}'s adapter differs from its model family's (another lora.*?)")
            self.partition_of[nid] = info.partition_id
            self.model_of[nid] = info.model
            self.family_of_partition[info.partition_id] = family
            self.model_of_family.setdefault(family, info.model)
            self.initial.setdefault(family, {k: v.copy() for k, v in info.initial.items()})
        if self.secure:
            sizes: dict[str, int] = {}
            for family in self.family_of_partition.values():
                sizes[family] = sizes.get(family, 0) + 1
            small = {f: n for f, n in sorted(sizes.items()) if n < MIN_SECURE_GROUP}
            if small:
                raise ValueError(
                    f"secure=true: model families {small} have fewer than {MIN_SECURE_GROUP} clients; {self.name} "
                    f"groups clients within a base model, so SecAgg+ would leak their updates"
                )

    def refreshes(self, server_round: int) -> bool:
        """Whether every client taking part this round reports a new fingerprint (round 1, then every
        ``refresh_every`` rounds)."""
        return server_round == 1 or (self.refresh_every > 0 and (server_round - 1) % self.refresh_every == 0)

    def report_nodes(self, server_round: int, node_ids: list[int]) -> list[int]:
        """On a refresh round every sampled client; between refreshes only the sampled clients without a
        fingerprint. A fingerprint is taken at the run's initial adapter, so it describes the client's data
        whichever round it was taken in: with sampling, one taken when a client is first sampled is as current as
        round 1's, and the clients that sit a round out keep theirs."""
        if self.refreshes(server_round):
            return list(node_ids)
        # and again while a client's fingerprint is missing (it was left out, not sampled yet, or it joined late)
        return [nid for nid in node_ids if self.partition_of.get(nid) not in self.reports]

    def read_report(self, arrays: Arrays, metrics: dict[str, Any]) -> FingerprintReport:
        """A valid fingerprint (``read_fingerprint``) naming no more layers than its model's adapter has arrays."""
        report = read_fingerprint(arrays, metrics)
        initial = self.initial.get(family_key(str(metrics.get("model", ""))))
        if initial is not None and len(report.layer_names) > len(initial):
            raise ValueError(
                f"{LAYER_NAMES}: {len(report.layer_names)} layers, more than the {len(initial)} arrays of its model's "
                "adapter"
            )
        return report

    def observe_reports(self, server_round: int, reports: dict[int, FingerprintReport]) -> dict[int, str]:
        left_out: dict[int, str] = {}
        fresh: dict[str, dict[int, FingerprintReport]] = {}
        for nid, report in reports.items():
            if nid in self.partition_of:
                fresh.setdefault(self.family_of_partition[self.partition_of[nid]], {})[nid] = report
        for family, family_reports in sorted(fresh.items()):
            # a report replaces its client's fingerprint; the clients that did not report (not sampled) keep theirs.
            # Comparable only with the same sketch and layers: the layout most of the family has wins.
            reporters = {self.partition_of[nid] for nid in family_reports}
            kept = [r for p, r in self.reports.items() if self.family_of_partition[p] == family and p not in reporters]
            layouts = [(r.fingerprint.size, tuple(r.layer_names)) for r in [*family_reports.values(), *kept]]
            common = max(sorted(set(layouts)), key=layouts.count)
            for nid, report in family_reports.items():
                if (report.fingerprint.size, tuple(report.layer_names)) != common:
                    left_out[nid] = (
                        f"fingerprint has {report.fingerprint.size} numbers over {len(report.layer_names)} layers, "
                        f"the family's others {common[0]} over {len(common[1])}"
                    )
                    self.reports.pop(self.partition_of[nid], None)  # it sits out until it sends a valid one
                else:
                    self.reports[self.partition_of[nid]] = report
        self.refresh(server_round, sorted(fresh))
        return left_out

    def refresh(self, server_round: int, families: list[str]) -> None:
        """Recompute the PCA of these families from the kept reports, then the strategy's structure."""
        for family in families:
            members = sorted(p for p, f in self.family_of_partition.items() if f == family and p in self.reports)
            self.members[family] = members
            if len(members) < 2:
                self.reduced.pop(family, None)
                continue
            points = np.stack([self.reports[p].fingerprint for p in members])
            reduced = reduce_fingerprints(points, self.dim, self.seed)
            self.reduced[family] = reduced
            log.info(
                "round %d: %s fingerprints of %d clients (%s): PCA to %d dims explains %.3f of the variance",
                server_round,
                self.label,
                len(members),
                family,
                reduced.points.shape[1],
                reduced.explained_variance,
            )
            if reduced.explained_variance < LOW_EXPLAINED_VARIANCE:
                log.warning(
                    "round %d: low explained variance %.2f (< %.1f) for %s: the fingerprints carry a weak signal",
                    server_round,
                    reduced.explained_variance,
                    LOW_EXPLAINED_VARIANCE,
                    family,
                )
        self.regroup(server_round, families)

    def regroup(self, server_round: int, families: list[str]) -> None:
        """Rebuild the strategy's structure (clusters, adjacency) for these families from ``self.reduced``."""
        raise NotImplementedError

    def family_report(self) -> dict[str, Any]:
        """Per family: its clients, their tasks, and the PCA's explained variance and points (for the plots)."""
        return {
            family: {
                "partitions": members,
                "tasks": [self.reports[p].tasks for p in members],
                "explained_variance": self.reduced[family].explained_variance if family in self.reduced else None,
                "points": self.reduced[family].points[:, :2].round(6).tolist() if family in self.reduced else [],
            }
            for family, members in sorted(self.members.items())
        }

    def fingerprint_state(self) -> dict[str, Arrays]:
        """The kept reports, for the checkpoint (``fingerprint-<partition>``)."""
        return {
            f"fingerprint-{pid}": {
                "fingerprint": report.fingerprint,
                "importance": report.importance,
                "layer_names": np.array(report.layer_names),
                "tasks": np.array([report.tasks]),
                "memory_mb": np.array([np.nan if report.memory_mb is None else report.memory_mb]),
            }
            for pid, report in sorted(self.reports.items())
        }

    def load_fingerprint_state(self, state: dict[str, Arrays]) -> None:
        """Restore the kept reports and rebuild the structure from them (resume: the same clusters or graph)."""
        for key, arrays in state.items():
            if key.startswith("fingerprint-"):
                self.reports[int(key.removeprefix("fingerprint-"))] = FingerprintReport(
                    np.asarray(arrays["fingerprint"], dtype=np.float64),
                    [str(n) for n in arrays["layer_names"].tolist()],
                    np.asarray(arrays["importance"], dtype=np.float64),
                    str(arrays["tasks"][0]),
                    None if np.isnan(arrays["memory_mb"][0]) else float(arrays["memory_mb"][0]),
                )
        families = sorted({self.family_of_partition[p] for p in self.reports if p in self.family_of_partition})
        if families:
            self.refresh(0, families)
