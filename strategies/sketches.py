"""Helpers shared by the strategies whose clients describe their data to the server (SimGrad's signatures,
ATLAS's and MIRA's fingerprints): a seeded count sketch every client draws alike, and the sanitisation applied
before a description leaves the client (EMA across rounds, noise relative to its RMS, coordinate subsampling).
"""

from __future__ import annotations

import numpy as np


def count_sketch(vocab_size: int, buckets: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(bucket, sign): for every vocabulary id a bucket in [0, buckets) (int64) and a sign in {-1, +1} (float32).

    Drawn from ``np.random.default_rng(seed)``, so every client with the same seed uses the same sketch and their
    signatures are comparable coordinate by coordinate.
    """
    if vocab_size < 1 or buckets < 1:
        raise ValueError(f"vocab_size and buckets must be >= 1, got {vocab_size} and {buckets}")
    rng = np.random.default_rng(seed)
    bucket = rng.integers(0, buckets, size=vocab_size, dtype=np.int64)
    sign = (2 * rng.integers(0, 2, size=vocab_size) - 1).astype(np.float32)
    return bucket, sign


def sanitize_signature(
    gradient: np.ndarray,
    ema: np.ndarray | None,
    decay: float,
    noise_scale: float,
    keep_fraction: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Smooth, noise and subsample a gradient signature; return (signature float32, new EMA float64).

    ema_new = gradient if ema is None else decay * ema + (1 - decay) * gradient. Then Gaussian noise with standard
    deviation ``noise_scale * rms(ema_new)`` is added: the noise is RELATIVE to the signature's root-mean-square,
    so one setting (e.g. 0.5 = noise at half the typical coordinate size) fits any model and any sketch size.
    Finally a random subset of max(1, round(keep_fraction * m)) of the m coordinates is kept and the rest zeroed.
    The EMA (the client's state) holds no noise. Raises ValueError for decay outside [0, 1), keep_fraction
    outside (0, 1] or a negative noise_scale.
    """
    if not 0 <= decay < 1:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    if not 0 < keep_fraction <= 1:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    if not noise_scale >= 0:
        raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
    grad = np.asarray(gradient, dtype=np.float64)
    if ema is not None and np.shape(ema) != grad.shape:
        raise ValueError(f"ema shape {np.shape(ema)} does not match gradient shape {grad.shape}")
    ema_new = grad.copy() if ema is None else decay * np.asarray(ema, dtype=np.float64) + (1 - decay) * grad
    noisy = ema_new.copy()
    if noise_scale > 0:
        rms = float(np.sqrt(np.mean(ema_new**2))) if ema_new.size else 0.0
        noisy += rng.normal(0.0, noise_scale * rms, size=ema_new.shape)
    m = noisy.size
    keep = max(1, int(round(keep_fraction * m)))
    if keep < m:
        mask = np.zeros(m, dtype=bool)
        mask[rng.choice(m, size=keep, replace=False)] = True
        noisy = np.where(mask.reshape(noisy.shape), noisy, 0.0)
    return noisy.astype(np.float32), ema_new


def report_vector(arrays: dict[str, np.ndarray], name: str, max_size: int, max_abs: float) -> np.ndarray:
    """A client's description vector ``arrays[name]`` as float32, refused (ValueError naming why) unless it is a
    1-D vector of 1..``max_size`` finite numbers within +-``max_abs`` (their squares must not overflow a
    distance or a cosine)."""
    vector = arrays.get(name)
    if vector is None:
        raise ValueError(f"report lacks the '{name}' array")
    if vector.ndim != 1 or not 0 < vector.size <= max_size:
        raise ValueError(f"{name} must be a vector of 1 to {max_size} numbers, got {vector.shape}")
    with np.errstate(over="ignore"):  # beyond float32: Inf, refused below
        vector = np.asarray(vector, dtype=np.float32)
    if not np.all(np.isfinite(vector)):
        raise ValueError(f"{name} contains NaN or Inf (as float32)")
    largest = float(np.abs(vector).max())
    if largest > max_abs:
        raise ValueError(f"{name} values must be within +-{max_abs:g}, got {largest:.3g}")
    return vector
