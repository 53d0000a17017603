"""ATLAS phase 2 as pure functions: per-layer LoRA ranks under a memory budget (``allocate_ranks``; every client's
of a clustering, ``plan_ranks``), the ranks a group travels at and what a client is sent at them (``wire_ranks``,
``padded``), averaging adapters whose ranks differ (zero-padded rank slots, averaged over the clients that have
each slot) and the allocation's metrics row (``rank_rows``).

A "layer" here is one adapted module (block b's q_proj, ...), with its input and output width. NumPy in, NumPy out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.adapters.lora import ranks as lora_ranks

Arrays = dict[str, np.ndarray]

RANK_CHOICES = (4, 8, 16, 32, 64)  # seed 003's candidates
# Training memory per adapter parameter: the fp32 weight, its gradient and AdamW's two moments.
BYTES_PER_PARAMETER = 4 * 4
MB = 1 << 20


@dataclass(frozen=True)
class Layer:
    """One adapted module: its name (``block3.q_proj``), input and output width."""

    name: str
    fan_in: int
    fan_out: int

    def parameters(self, rank: int) -> int:
        """LoRA's A (rank x fan_in) and B (fan_out x rank)."""
        return rank * (self.fan_in + self.fan_out)


def lora_layers(initial: Arrays) -> list[Layer]:
    """A LoRA adapter's layers (its sorted layer paths) with their widths (A is rank x fan_in, B fan_out x rank)."""
    return [
        Layer(path, int(initial[a].shape[1]), int(initial[b].shape[0]))
        for path, (a, b) in lora_ranks.layers(initial).items()
    ]


def adapter_mb(layers: Sequence[Layer], ranks: Sequence[int]) -> float:
    """The adapter's training memory in MiB at these ranks (weights, gradients, AdamW moments; fp32)."""
    return sum(layer.parameters(r) for layer, r in zip(layers, ranks)) * BYTES_PER_PARAMETER / MB


def allocate_ranks(
    layers: Sequence[Layer], importance: Sequence[float], budget_mb: float, choices: Sequence[int] = RANK_CHOICES
) -> list[int]:
    """Seed 003's greedy allocation: every layer starts at the smallest rank; then, most important layer first, each
    is raised to the largest rank whose extra memory still fits the budget.

    Raises ValueError when even the smallest rank everywhere exceeds ``budget_mb`` (the budget fits no rank).
    """
    if len(layers) != len(importance):
        raise ValueError(f"{len(layers)} layers but {len(importance)} importances")
    choices = sorted(set(choices))
    floor = adapter_mb(layers, [choices[0]] * len(layers))
    if floor > budget_mb:
        raise ValueError(
            f"a memory budget of {budget_mb:g} MB fits no rank: rank {choices[0]} on all {len(layers)} layers "
            f"needs {floor:.3f} MB"
        )
    ranks = [choices[0]] * len(layers)
    used = floor
    # most important first; ties in layer order, so the allocation is deterministic
    for index in sorted(range(len(layers)), key=lambda i: (-float(importance[i]), i)):
        layer = layers[index]
        for rank in reversed(choices):
            extra = (layer.parameters(rank) - layer.parameters(ranks[index])) * BYTES_PER_PARAMETER / MB
            if rank > ranks[index] and used + extra <= budget_mb:
                ranks[index] = rank
                used += extra
                break
    return ranks


def check_budget(layers: Sequence[Layer], budget_mb: float | None, choices: Sequence[int]) -> None:
    """Raise ValueError (``allocate_ranks``') when ``budget_mb`` fits no rank on these layers; None: no budget."""
    if budget_mb is not None:
        allocate_ranks(layers, [0.0] * len(layers), budget_mb, choices)


@dataclass(frozen=True)
class MemberRanks:
    """One client's allocation: its rank per layer (in the layers' order) and its cluster's complexity scale."""

    ranks: list[int]
    scale: float


def plan_ranks(
    layers: Sequence[Layer],
    fingerprints: np.ndarray,
    labels: np.ndarray,
    importances: Sequence[Mapping[str, float]],
    budgets: Sequence[float | None],
    choices: Sequence[int],
) -> list[MemberRanks | None]:
    """Every member's ranks after a clustering (members in ``labels``' order; None for one without a budget):
    greedy by its layer importances (by layer name; a layer it did not name counts 0) within its budget times its
    cluster's complexity scale (seed 003: more heterogeneous, harder clusters get more capacity), never below the
    smallest rank on every layer."""
    scales = complexity_scale(fingerprints, labels)
    floor = adapter_mb(layers, [min(choices)] * len(layers))
    plans: list[MemberRanks | None] = []
    for label, importance, budget in zip(labels.tolist(), importances, budgets):
        if budget is None:
            plans.append(None)
            continue
        scale = scales[int(label)]
        weights = [importance.get(layer.name, 0.0) for layer in layers]
        plans.append(MemberRanks(allocate_ranks(layers, weights, max(budget * scale, floor), choices), scale))
    return plans


def complexity_scale(fingerprints: np.ndarray, labels: np.ndarray) -> dict[int, float]:
    """Seed 003's cluster coupling: complexity_c = variance of c's fingerprints x their mean norm, normalised by
    the largest cluster's; the scale 0.5 + 0.5 * normalised complexity (in [0.5, 1]) per cluster label.

    ATLAS multiplies a client's memory budget by its cluster's scale: a greedy allocation is unchanged by scaling
    every importance by one constant, so the coupling acts on how much of the budget a cluster spends.
    """
    x = np.asarray(fingerprints, dtype=np.float64)
    complexity = {}
    for label in sorted(set(np.asarray(labels).tolist())):
        members = x[np.asarray(labels) == label]
        complexity[int(label)] = float(np.var(members, axis=0).mean() * np.linalg.norm(members, axis=1).mean())
    top = max(complexity.values(), default=0.0)
    return {c: 0.5 + 0.5 * (v / top if top > 0 else 1.0) for c, v in complexity.items()}


def slot_average(weighted_mean: np.ndarray, mask_mean: np.ndarray, axis: int) -> np.ndarray:
    """Per rank slot: the members' weighted mean restricted to those who have the slot.

    With padded members x_i (zero beyond their rank) and masks m_i, a group's weighted means are
    X = sum_i w_i x_i / W and M = sum_i w_i m_i / W (both plain sums, so SecAgg+ gives them), and
    X / M = sum_{i has slot} w_i x_i / sum_{i has slot} w_i along ``axis`` (the rank axis: 0 for A, 1 for B).
    A slot no member has stays 0.
    """
    m = np.asarray(mask_mean, dtype=np.float64)
    shape = [1, 1]
    shape[axis] = m.size
    safe = np.where(m > 0, m, 1.0).reshape(shape)
    return np.where(m.reshape(shape) > 0, np.asarray(weighted_mean, dtype=np.float64) / safe, 0.0).astype(np.float32)


def mask_problem(mean: Arrays, weights: Sequence[float], tolerance: float = 1e-3) -> str | None:
    """Why a group mean's slot masks cannot come from members of these ``weights`` (None if they can). Each member
    sends masks of 0 and 1, so a slot's mean mask is the share of the group's weight that has the slot: 0, or at
    least the smallest member's share, and at most 1. ``slot_average`` divides by it: a member that sends a mask of
    -(n - 1) + e shrinks it to about e / n and multiplies that slot's average (37 instead of 0.057 in a review),
    inside the box and norm checks."""
    total = float(sum(weights))
    least = min(weights) / total if total > 0 else 0.0  # weights not known: only the range is checked
    for name, mask in mean.items():
        if not name.startswith(lora_ranks.MASK_PREFIX):
            continue
        m = np.asarray(mask, dtype=np.float64)
        if not np.all(np.isfinite(m)) or m.min() < -tolerance or m.max() > 1 + tolerance:
            return f"{name}: a slot's mean mask outside [0, 1]"
        thin = m[(m > tolerance) & (m < least - tolerance)]
        if thin.size:
            return f"{name}: a slot's mean mask {thin.min():.3g} is below the least member's share {least:.3g}"
    return None


def slot_mean(mean: Arrays, fallback: Arrays | None) -> Arrays:
    """Every rank slot averaged over the members that have it (the group mean divided by the mean slot mask);
    a slot no contributing member has keeps ``fallback``'s value (the group's start)."""
    out: Arrays = {}
    for path, (a_name, b_name) in lora_ranks.layers(lora_ranks.without_masks(mean)).items():
        mask = mean[lora_ranks.MASK_PREFIX + path]
        for name, axis in ((a_name, 0), (b_name, 1)):
            averaged = slot_average(mean[name], mask, axis)
            if fallback is not None:
                shape = [1, 1]
                shape[axis] = mask.size
                averaged = np.where(mask.reshape(shape) > 0, averaged, fallback[name]).astype(np.float32)
            out[name] = averaged
    return out


class RankPlan:
    """The clients that train at their own per-layer ranks (ATLAS: after each clustering, every client with a memory
    budget, ``plan_ranks``) and how a unit's mean is read back then (``slot_mean``): the rank side of the server.

    Attributes:
        ranks_of: partition -> its rank per LoRA layer path; scale_of: partition -> its cluster's complexity scale.
        slot_fallback: unit -> what a slot no contributing member has keeps (the unit's start, without masks).
    """

    def __init__(self, choices: Sequence[int]) -> None:
        self.choices = choices
        self.ranks_of: dict[int, dict[str, int]] = {}
        self.scale_of: dict[int, float] = {}
        self.slot_fallback: dict[str, Arrays] = {}

    @property
    def any_own_ranks(self) -> bool:
        """Whether any client has its own ranks (then every instruction says each member's and its group's)."""
        return bool(self.ranks_of)

    def allocate(
        self,
        layers: Sequence[Layer],
        members: Sequence[int],
        fingerprints: np.ndarray,
        labels: np.ndarray,
        importances: Sequence[Mapping[str, float]],
        budgets: Sequence[float | None],
    ) -> list[tuple[int, MemberRanks]]:
        """Every member's ranks after a clustering (``plan_ranks``; a member without a budget has none now); the
        members given ranks, with their allocation."""
        given = []
        plans = plan_ranks(layers, fingerprints, labels, importances, budgets, self.choices)
        for partition, plan in zip(members, plans):
            if plan is None:
                self.ranks_of.pop(partition, None)
                continue
            self.ranks_of[partition] = {layer.name: r for layer, r in zip(layers, plan.ranks)}
            self.scale_of[partition] = plan.scale
            given.append((partition, plan))
        return given

    def own(self, partition: int, initial: Arrays) -> dict[str, int]:
        """``partition``'s ranks: its own, else those of its family's ``initial`` adapter."""
        return self.ranks_of.get(partition) or lora_ranks.ranks(initial)

    def start(self, unit: str, arrays: Arrays) -> None:
        """Keep what ``unit`` starts from (one member's arrays): its slots that no contributing member has keep it."""
        self.slot_fallback[unit] = lora_ranks.without_masks(arrays)

    def finish(self, mean: Arrays, unit: str) -> Arrays:
        """A unit's mean as its members' adapter: with ranks, every slot averaged over the members that have it."""
        return slot_mean(mean, self.slot_fallback.get(unit)) if self.any_own_ranks else mean

    def rows(self, layers: Sequence[Layer], partitions: Sequence[int], budgets: Mapping[int, float | None]) -> dict:
        """The allocation of a family's ``partitions`` in its metrics row (``rank_rows``)."""
        return rank_rows(layers, partitions, self.ranks_of, budgets, self.scale_of)


def wire_ranks(sizes: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per layer, the largest of these ranks (each a layer -> rank map): what a group's arrays travel at."""
    return {path: max(s[path] for s in sizes) for path in sizes[0]}


def padded(adapter: Arrays, own: dict[str, int], wire: dict[str, int], seed: int) -> Arrays:
    """``adapter`` at the ``wire`` ranks (the slots it lacks seeded alike for every client, ``seeded_slots``) with
    the slot masks of a client whose own ranks are ``own``."""
    resized = lora_ranks.seeded_slots(lora_ranks.resize(adapter, wire), lora_ranks.ranks(adapter), seed)
    return {**resized, **lora_ranks.masks(own, wire)}


def rank_rows(
    layers: Sequence[Layer],
    partitions: Sequence[int],
    ranks_of: Mapping[int, Mapping[str, int]],
    budgets: Mapping[int, float | None],
    scales: Mapping[int, float],
) -> dict[str, Any]:
    """A family's allocation in its metrics row: the layer names and, per client of ``partitions`` with ranks, its
    ranks, adapter size, budget and scale (nothing when none has ranks)."""
    ranked = [p for p in partitions if p in ranks_of]
    if not ranked:
        return {}
    ranks = {str(p): [ranks_of[p][layer.name] for layer in layers] for p in ranked}
    return {
        "layers": [layer.name for layer in layers],
        "ranks": ranks,
        "adapter_mb": {str(p): adapter_mb(layers, ranks[str(p)]) for p in ranked},
        "budget_mb": {str(p): budgets[p] for p in ranked},
        "budget_scale": {str(p): scales[p] for p in ranked},
    }
