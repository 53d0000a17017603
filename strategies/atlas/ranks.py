"""ATLAS phase 2 as pure functions: per-layer LoRA ranks under a memory budget, and averaging adapters whose ranks
differ (zero-padded rank slots, averaged over the clients that have each slot).

A "layer" here is one adapted module (block b's q_proj, ...), with its input and output width. NumPy in, NumPy out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
