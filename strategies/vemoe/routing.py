"""VEMoE's client-side math as pure functions: domain responsibilities from probe losses, the client's top-m
experts, and the token-level mixture inside them (seed 002's hierarchical routing).

For client i with live experts k (slots of the pool that hold an expert):
- responsibilities r_ik = softmax_k(-loss_ik / T) over the live experts, from each expert's loss on a probe
  batch of the client's own data; a free slot has r_ik = 0;
- the client's top-m set: the m live experts of largest r_ik, which it trains and routes between;
- token mixture alpha_tk = softmax_k(log r_ik + u_tk / gamma) over the top-m, u_tk a router's logit for token t:
  it runs inside the forward pass, so it lives with the adapter (``common.adapters.experts.layer.token_mixture``).
"""

from __future__ import annotations

import numpy as np


def responsibilities(
    probe_losses: np.ndarray, live: np.ndarray, temperature: float, prior: np.ndarray | None = None
) -> np.ndarray:
    """r (K_max,): softmax of log prior - loss / ``temperature`` over the live slots, 0 elsewhere; sums to 1 (no
    ``prior``, or one without mass on the live slots: uniform). With summed negative log-likelihoods and a
    temperature of 1 it is the posterior over experts.

    ``probe_losses[k]`` is read only where ``live[k]``; a live slot's loss must be finite (a NaN or infinite
    probe loss is a broken expert or batch, not a preference: ValueError).
    """
    losses = np.asarray(probe_losses, dtype=np.float64)
    mask = np.asarray(live, dtype=bool)
    if losses.shape != mask.shape or losses.ndim != 1:
        raise ValueError(f"{losses.shape} probe losses for {mask.shape} slots")
    if not mask.any():
        raise ValueError("no live expert to be responsible")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not np.all(np.isfinite(losses[mask])):
        raise ValueError(f"live experts' probe losses must be finite, got {losses[mask].tolist()}")
    weights = np.ones_like(losses) if prior is None else np.clip(np.nan_to_num(np.asarray(prior, np.float64)), 0, None)
    if not (weights[mask] > 0).any():
        weights = np.ones_like(losses)
    with np.errstate(divide="ignore"):
        log_prior = np.log(np.where(mask, weights, 0.0))
    logits = np.where(mask & (weights > 0), log_prior - losses / temperature, -np.inf)
    logits -= logits[np.isfinite(logits)].max()
    r = np.where(np.isfinite(logits), np.exp(logits), 0.0)
    return r / r.sum()


def tied(probe_losses: np.ndarray, live: np.ndarray, tolerance: float = 1e-6) -> bool:
    """Whether every live expert serves the probe batch equally (relative ``tolerance``): experts that still
    compute the base model (B = 0, round 1), between which the losses say nothing."""
    losses = np.asarray(probe_losses, dtype=np.float64)[np.asarray(live, dtype=bool)]
    return bool(losses.size) and float(np.ptp(losses)) <= tolerance * max(1.0, float(np.abs(losses).max()))


def gain_shares(gains: np.ndarray, live: np.ndarray) -> np.ndarray:
    """r (K_max,) from each live expert's first-order gain on the probe batch (``ExpertsAdapter.probe_gain``):
    its share of the live experts' gains (uniform if none has any), 0 on free slots. It breaks the round-1 tie by
    the client's own data: clients whose gradients fall in one expert's subspace pick that expert."""
    mask = np.asarray(live, dtype=bool)
    g = np.where(mask, np.nan_to_num(np.asarray(gains, dtype=np.float64), nan=0.0).clip(min=0.0), 0.0)
    if not mask.any():
        raise ValueError("no live expert to be responsible")
    return g / g.sum() if g.sum() > 0 else mask / mask.sum()


def unserved(r: np.ndarray, live: np.ndarray, spread: float) -> bool:
    """Whether no expert serves a client distinctively: its responsibilities' entropy is above ``spread`` (0..1) of
    the most the live experts allow (log of their count), i.e. it tells them apart no better than that. Such a
    client votes for a birth: its candidate becomes an expert of its own. ``spread`` 0: never (off)."""
    mask = np.asarray(live, dtype=bool)
    if not spread or mask.sum() < 2:
        return False
    p = np.asarray(r, dtype=np.float64)[mask]
    p = p[p > 0]
    return float(-(p * np.log(p)).sum()) > spread * float(np.log(mask.sum()))


def top_m(r: np.ndarray, m: int, tie_order: np.ndarray | None = None) -> np.ndarray:
    """The (at most) ``m`` slots of largest responsibility among those with r > 0, ascending slot order. Ties go to
    the slot earlier in ``tie_order`` (a permutation of the slots; default: the lower slot). New experts are all the
    base model, so every client ties on them: a per-client order spreads clients over them instead of starving the
    higher slots."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    r = np.asarray(r, dtype=np.float64)
    order = np.arange(len(r)) if tie_order is None else np.asarray(tie_order)
    rank = np.empty(len(r), dtype=np.int64)
    rank[order] = np.arange(len(r))
    candidates = np.flatnonzero(r > 0)
    ranked = candidates[np.lexsort((rank[candidates], -r[candidates]))]
    return np.sort(ranked[:m])
