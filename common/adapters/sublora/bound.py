"""SubLoRA's compression-based generalisation bound (seed 004; Lotfi et al., "PAC-Bayes Compression Bounds So Tight
That They Can Explain Generalization", NeurIPS 2022, and "Non-Vacuous Generalization Bounds for Large Language
Models", ICML 2024).

The hypothesis is the trained alpha (and gates), everything else being fixed before the data is seen (base model,
theta_0 and P from the seed). It is described by a prefix-free code:

1. ``quantise``: alpha's d numbers -> a codebook of at most ``levels`` values (1-D k-means, scikit-learn) and one
   index per coordinate;
2. ``encode``: the indices arithmetic-coded (a range coder from ``constriction``) under their own empirical
   distribution;
3. ``code_length``: C(h) = a 64-bit header (d, levels) + 32 bits per codebook value + ceil(log2(d + 1)) bits per
   symbol count (the coder's model) + the range coder's words + 32 bits per gate (learned mode), all fixed-width or
   self-delimiting, so the code is prefix-free and the prior P(h) = 2^-C(h) sums to at most 1 (Kraft).

With probability at least 1 - delta over m i.i.d. training examples (the example, not the token, is the i.i.d.
unit), for both risks at once (delta / 2 each, a union bound):

- smoothed log-loss in bits per token, bounded by Delta = log2(V / a) with prediction smoothing a (Lotfi et al.
  2024, eq. 2; Occam's bound with Hoeffding):  R <= R_hat + Delta sqrt((C ln 2 + ln(2 / delta)) / (2 m));
- top-1 error per token, in [0, 1] (Occam's bound with the binary kl: Langford 2005, "Tutorial on practical
  prediction theory", Thm 4.6, with Maurer 2004's ln(2 sqrt(m) / delta), which holds for [0, 1]-valued losses
  and m >= 8):
  kl(R_hat || R) <= (C ln 2 + ln(4 sqrt(m) / delta)) / m, R = the largest p that satisfies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HEADER_BITS = 64
FLOAT_BITS = 32


def quantise(values: np.ndarray, levels: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(codebook ascending (k,), index per value (n,)) with k <= ``levels``: 1-D k-means on the values."""
    from sklearn.cluster import KMeans

    values = np.asarray(values, dtype=np.float64).reshape(-1)
    distinct = np.unique(values)
    if len(distinct) <= levels:  # exact: every value is its own level
        return distinct.astype(np.float32), np.searchsorted(distinct, values).astype(np.int32)
    km = KMeans(n_clusters=levels, n_init=4, random_state=seed).fit(values.reshape(-1, 1))
    centres = km.cluster_centers_[:, 0]
    order = np.argsort(centres)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return centres[order].astype(np.float32), rank[km.labels_].astype(np.int32)


def _model(counts: np.ndarray):
    import constriction

    probabilities = counts.astype(np.float64) / counts.sum()
    return constriction.stream.model.Categorical(probabilities, perfect=False)


def encode(indices: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(range-coded words (uint32), symbol counts (levels,)): the counts are the coder's model, sent with it."""
    import constriction

    indices = np.asarray(indices, dtype=np.int32)
    counts = np.bincount(indices, minlength=levels)
    encoder = constriction.stream.queue.RangeEncoder()
    encoder.encode(indices, _model(counts))
    return encoder.get_compressed(), counts


def decode(words: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices ``encode`` coded (as many as the counts add up to)."""
    import constriction

    decoder = constriction.stream.queue.RangeDecoder(np.asarray(words, dtype=np.uint32))
    return np.asarray(decoder.decode(_model(counts), int(counts.sum())), dtype=np.int32)


def code_length(num_values: int, codebook_size: int, words: np.ndarray, num_gates: int = 0) -> int:
    """C(h) in bits (see the module docstring)."""
    count_bits = math.ceil(math.log2(num_values + 1))
    return (
        HEADER_BITS + FLOAT_BITS * codebook_size + count_bits * codebook_size + 32 * len(words) + FLOAT_BITS * num_gates
    )


def binary_kl(q: float, p: float) -> float:
    """kl(q || p) between Bernoulli(q) and Bernoulli(p), in nats."""
    eps = 1e-12
    p = min(max(p, eps), 1 - eps)
    out = 0.0
    if q > 0:
        out += q * math.log(q / p)
    if q < 1:
        out += (1 - q) * math.log((1 - q) / (1 - p))
    return out


def kl_inverse(q: float, c: float) -> float:
    """The largest p in [q, 1] with kl(q || p) <= c (bisection)."""
    lo, hi = q, 1.0
    if binary_kl(q, hi) <= c:
        return 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if binary_kl(q, mid) <= c else (lo, mid)
    return lo


@dataclass(frozen=True)
class Bound:
    """What ``bounds`` reports (risks per token; ``bits_per_token`` in bits)."""

    code_bits: int
    examples: int
    train_bits_per_token: float
    train_top1_error: float
    bits_per_token: float  # the bound on the smoothed log-loss
    top1_error: float  # the bound on the top-1 error
    max_bits: float  # Delta = log2(V / smoothing)


def empirical_risk(per_example: list[tuple[float, int, int]]) -> tuple[float, float, int]:
    """(bits per token, top-1 error, examples): each example's risk is its mean per answer token, the empirical
    risk their mean over the examples that have an answer token."""
    used = [(b / n, e / n) for b, e, n in per_example if n > 0]
    if not used:
        raise ValueError("bound: no training example has an answer token")
    return sum(b for b, _ in used) / len(used), sum(e for _, e in used) / len(used), len(used)


def bounds(
    code_bits: int, per_example: list[tuple[float, int, int]], vocab: int, smoothing: float, delta: float
) -> Bound:
    """The two bounds from C(h) and per-example (bits summed over tokens, top-1 errors, tokens) on the training
    data (``empirical_risk``)."""
    bits_hat, error_hat, m = empirical_risk(per_example)
    max_bits = math.log2(vocab / smoothing)
    complexity = code_bits * math.log(2)
    bits = bits_hat + max_bits * math.sqrt((complexity + math.log(2 / delta)) / (2 * m))
    error = kl_inverse(error_hat, (complexity + math.log(4 * math.sqrt(m) / delta)) / m)
    return Bound(code_bits, m, bits_hat, error_hat, bits, error, max_bits)
