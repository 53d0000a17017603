"""Aggregation math as pure functions over groups (NumPy in, NumPy out; no Flower).

"Strategies speak in sums": SecAgg+ can give the server, for one group of clients, the weighted mean
sum_i w_i x_i / sum_i w_i and nothing else. Every strategy is therefore written as (1) a choice of groups and of
what each member sends, (2) group means, (3) a combination of group means. This module holds (2) and the
reference implementations that the secure path is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Arrays = dict[str, np.ndarray]


def weighted_mean(updates: Sequence[Arrays], weights: Sequence[float]) -> Arrays:
    """sum_i w_i x_i / sum_i w_i, key by key, accumulated in float64 and returned as float32."""
    if not updates:
        raise ValueError("weighted_mean of no updates")
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    keys = list(updates[0])
    out = {}
    for key in keys:
        acc = np.zeros(np.shape(updates[0][key]), dtype=np.float64)
        for wi, update in zip(w, updates):
            acc += wi * np.asarray(update[key], dtype=np.float64)
        out[key] = (acc / w.sum()).astype(np.float32)
    return out


def secagg_weights(num_examples: Sequence[int], max_weight: float) -> list[float]:
    """The weights SecAgg+ applies: num_examples / max_weight, at most 1 (our members cap their weight)."""
    return [min(n / max_weight, 1.0) for n in num_examples]


def secagg_error_bound(weights: Sequence[float], clipping_range: float, quantization_range: int) -> float:
    """An upper bound on |SecAgg+ mean - exact weighted mean| per coordinate, for values inside the clipping range.

    Each member's weighted value is quantised (stochastic rounding) on a grid of step
    2 * clipping_range / quantization_range, an error below one step each; the server divides the sum of the
    members' errors by the total weight.
    """
    step = 2.0 * clipping_range / quantization_range
    return len(weights) * step / sum(weights)
