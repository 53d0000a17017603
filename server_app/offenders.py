"""Refused sums, and finding the member behind them when SecAgg+ hides who it is (group testing).

A group's mean is refused as a whole when it cannot come from honest members: a secure aggregate outside the box or
norm bounds, a weight masked other than reported (``server_app.secure``), or a sum the strategy divides by out of
what honest members can send (``Strategy.check_sum``). In secure mode the server cannot see which member did it, so
one hostile member could cost its group every round, anonymously. ``Offenders`` narrows it down:

- every member of a refused group gets a strike; a member of an accepted group is cleared (strikes back to 0);
- next round, a secure group holding suspects (members with strikes) is split into random subgroups of at least
  ``MIN_SECURE_GROUP`` members, the suspects spread over them, each its own SecAgg+ run; the strategy gets one mean
  per group all the same: the weight-combined mean of the subgroups that were accepted (the weighted mean over their
  members, exactly what one run over them would give);
- a member with ``robust.exclude-after`` strikes in a row is excluded from training for the rest of the run, and
  the log says who, after which rounds, and why.

With one hostile member among 9 in one group (VEMoE's): its group is refused (9 suspects); next round three
subgroups of 3, one refused (3 suspects, 6 cleared); then each suspect with two cleared members: only the hostile
one's subgroup is refused, and with ``exclude-after`` 3 it is excluded while the others train on
(``tests/test_offenders.py``). The strikes live in the ServerApp's memory: a resumed run starts without suspects.
What splitting costs: a subgroup is a smaller secure group (never below 3), so for the rounds it lasts the server
sees sums over fewer members.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from common.logs import get_logger
from strategies.base import MIN_SECURE_GROUP, Group, GroupResult

if TYPE_CHECKING:
    from strategies import Strategy

log = get_logger("tessera.server")
SUBGROUP = "/part-"  # a subgroup's name: its group's, then this and its number


def refuse_unsound_sums(strategy: Strategy, server_round: int, results: list[GroupResult]) -> None:
    """Refuse (no mean, the reason in ``aggregate_rejected``) every group mean ``strategy.check_sum`` says honest
    members cannot have sent, before the strategy divides by anything in it."""
    for result in results:
        if result.mean is not None and (problem := strategy.check_sum(result)):
            result.aggregate_rejected, result.mean = problem, None
            log.error("round %d: group %s's mean refused: %s", server_round, result.name, problem)


@dataclass
class Offenders:
    """Strikes per node, and the nodes excluded for them (``exclude_after`` 0: never excluded)."""

    exclude_after: int = 3
    seed: int = 0
    strikes: dict[int, int] = field(default_factory=dict)
    struck_in: dict[int, list[int]] = field(default_factory=dict)  # node -> the rounds of its current strikes
    excluded: dict[int, str] = field(default_factory=dict)  # node -> why

    def split(self, server_round: int, groups: list[Group]) -> list[Group]:
        """Each group holding suspects as subgroups of at least ``MIN_SECURE_GROUP`` members with the suspects
        spread over them (as many subgroups as suspects, as far as the members allow); the others as they are."""
        out = []
        for group in groups:
            suspects = [n for n in group.members if self.strikes.get(n)]
            parts = min(len(suspects), len(group.members) // MIN_SECURE_GROUP)
            if parts < 2:
                out.append(group)
                continue
            rng = random.Random(f"{self.seed}-{server_round}-{group.name}")
            clean = [n for n in group.members if not self.strikes.get(n)]
            rng.shuffle(suspects)
            rng.shuffle(clean)
            members: list[list[int]] = [[] for _ in range(parts)]
            for i, node in enumerate(suspects + clean):  # suspects first: one to each part before any doubles up
                members[i % parts].append(node)
            out += [  # each its own config (a subgroup's DP noise share is sized for its own members)
                replace(
                    group,
                    name=f"{group.name}{SUBGROUP}{k + 1}",
                    start={n: group.start[n] for n in part},
                    config=group.config,
                    member_configs={n: group.member_configs[n] for n in part if n in group.member_configs},
                )
                for k, part in enumerate(members)
            ]
            log.info(
                "round %d: group %s split into %d secure subgroups of %s to find who its refused aggregates hide",
                server_round,
                group.name,
                parts,
                [len(m) for m in members],
            )
        return out

    def observe(self, server_round: int, results: list[GroupResult]) -> list[int]:
        """Strikes for the members of refused (sub)groups, cleared ones for accepted; returns the nodes excluded
        now."""
        now = []
        for result in results:
            members = sorted({*result.contributors, *result.rejected, *result.metrics})
            if result.aggregate_rejected is None:
                for node in result.contributors:
                    self.strikes.pop(node, None)
                    self.struck_in.pop(node, None)
                continue
            for node in members:
                self.strikes[node] = self.strikes.get(node, 0) + 1
                self.struck_in.setdefault(node, []).append(server_round)
                if self.exclude_after and self.strikes[node] >= self.exclude_after and node not in self.excluded:
                    rounds = ", ".join(map(str, self.struck_in[node]))
                    why = (
                        f"in a refused secure aggregate {self.strikes[node]} rounds in a row (rounds {rounds}; last: "
                        f"{result.aggregate_rejected})"
                    )
                    self.excluded[node] = why
                    now.append(node)
                    log.error("node %d excluded from training: %s (robust.exclude-after)", node, why)
        return now


def combine(groups: list[Group], results: list[GroupResult]) -> list[GroupResult]:
    """One result per group of ``groups``: a split group's subgroups combined (the weight-combined mean of those
    accepted; refused when none was), the others as they came."""
    by_group: dict[str, list[GroupResult]] = {}
    for result in results:
        by_group.setdefault(result.name.split(SUBGROUP)[0], []).append(result)
    out = []
    for group in groups:
        parts = by_group.get(group.name, [])
        if len(parts) == 1 and parts[0].name == group.name:
            out.append(parts[0])
            continue
        accepted = [p for p in parts if p.mean is not None and p.total_weight > 0]
        total = sum(p.total_weight for p in accepted)
        mean = None
        if accepted:
            names = accepted[0].mean or {}
            weights = [p.total_weight for p in accepted]
            mean = {k: _weighted([(p.mean or {})[k] for p in accepted], weights) for k in names}
        refused = [f"{p.name}: {p.aggregate_rejected}" for p in parts if p.aggregate_rejected]
        out.append(
            GroupResult(
                group.name,
                mean,
                float(total),
                [n for p in accepted for n in p.contributors],
                {n: why for p in parts for n, why in p.rejected.items()},
                {n: m for p in parts for n, m in p.metrics.items()},
                "; ".join(refused) if refused and not accepted else None,
            )
        )
    return out


def _weighted(values: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """sum_s w_s x_s / sum_s w_s, computed in float64."""
    total = np.zeros(np.shape(values[0]), dtype=np.float64)
    for value, weight in zip(values, weights):
        total += np.asarray(value, dtype=np.float64) * weight
    return (total / sum(weights)).astype(np.float32)
