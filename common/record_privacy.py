"""Record-level differential privacy of a member's training (DP-SGD): the accountant and the budget, as plain
functions (numbers in, numbers out).

What is protected: one training record of one member (add-or-remove adjacency on the member's training split). Each
DP-SGD step draws its batch by Poisson sampling (every record in with probability ``q``), clips every example's
gradient to L2 norm ``C`` and adds N(0, (z C)^2) to their sum (``common.dpsgd``): one Poisson-subsampled Gaussian
mechanism of noise multiplier ``z`` per step. dp-accounting's Renyi DP accountant (Mironov 2017; Mironov, Talwar and
Zhang 2019 for the subsampled Gaussian; what Opacus and TensorFlow Privacy report) composes every step the member has
taken, across rounds, restarts and runs (the steps are kept in its node state: ``client_app.member_ledger``).

Everything the member sends that is computed from those noised steps (its adapter update, whatever a strategy
aggregates from it) is post-processing and costs nothing more; what is computed from the records outside them is not
covered (docs/privacy.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from common.privacy import least_noise

# the most noise a member may be asked to add: beyond it the gradient is noise for every model we train
MAX_RECORD_NOISE = 1e3


@dataclass(frozen=True)
class Steps:
    """``count`` DP-SGD steps at sampling rate ``q`` and noise multiplier ``z`` (one entry of a member's ledger)."""

    q: float
    z: float
    count: int


def _event(history: Iterable[Steps]):
    import dp_accounting

    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(s.q, dp_accounting.GaussianDpEvent(s.z)), s.count
        )
        for s in history
        if s.count > 0
    ]
    return dp_accounting.ComposedDpEvent(events)


def record_epsilon(history: Sequence[Steps], delta: float) -> float:
    """The epsilon at ``delta`` of every step in ``history`` composed (0 for none; infinity if any step had no noise
    but sampled records)."""
    steps = [s for s in history if s.count > 0 and s.q > 0]
    if not steps:
        return 0.0
    if min(s.z for s in steps) <= 0:
        return math.inf
    return _epsilon(tuple(steps), delta)


@lru_cache(maxsize=256)  # a member asks every round; the answer depends on the history and delta alone
def _epsilon(history: tuple[Steps, ...], delta: float) -> float:
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(_event(history))
    return float(accountant.get_epsilon(delta))


@lru_cache(maxsize=64)
def record_noise_for(target_epsilon: float, delta: float, q: float, steps: int, spent: tuple[Steps, ...] = ()) -> float:
    """The least noise multiplier z with which ``steps`` more steps at rate ``q``, after ``spent``, stay within
    ``target_epsilon`` at ``delta`` (dp-accounting's calibration); ValueError naming the budget when even
    ``MAX_RECORD_NOISE`` cannot."""
    if record_epsilon([*spent, Steps(q, MAX_RECORD_NOISE, steps)], delta) > target_epsilon:
        raise ValueError(
            f"no noise multiplier up to {MAX_RECORD_NOISE:g} keeps {steps} DP-SGD step(s) at sampling rate {q:.4g} "
            f"within epsilon {target_epsilon:g} at delta {delta:g}"
            + (f" after the {sum(s.count for s in spent)} step(s) already spent" if spent else "")
        )
    return least_noise(lambda z: _event([*spent, Steps(q, z, steps)]), target_epsilon, delta, lowest=1e-2)


def sampling_rate(expected_batch: int, records: int) -> float:
    """q: each record's chance of being in a step's batch, so that a batch holds ``expected_batch`` on average;
    ValueError when the split is too small to sample from (``expected_batch`` of at least all of it)."""
    if records <= expected_batch:
        raise ValueError(
            f"a training split of {records} record(s) is too small for batches of {expected_batch}: DP-SGD samples "
            "each record with probability batch / records, which must be below 1"
        )
    return expected_batch / records


@dataclass(frozen=True)
class RecordBudget:
    """A member's record-level budget as it applies: its target, delta and clip norm, and where each came from."""

    epsilon: float
    delta: float
    clip_norm: float
    source: str  # "node" (the member's own node config), "run" (the run's defaults, in simulation)


def effective_budget(
    node_epsilon: float | None,
    node_delta: float | None,
    node_clip: float | None,
    run_epsilon: float,
    run_max_epsilon: float,
    run_delta: float,
    run_clip: float,
) -> RecordBudget | None:
    """The budget a member trains under: its own (node config) where it set one, the run's default otherwise; the
    run's ceiling (``run_max_epsilon`` > 0) and delta only ever tighten it, never loosen it. None: no record-level
    DP (neither the member nor the run asks for it)."""
    epsilon = node_epsilon if node_epsilon is not None else (run_epsilon or None)
    if epsilon is None:
        return None
    if run_max_epsilon > 0:
        epsilon = min(epsilon, run_max_epsilon)
    delta = min(node_delta, run_delta) if node_delta is not None else run_delta
    clip = node_clip if node_clip is not None else run_clip
    return RecordBudget(epsilon, delta, clip, "node" if node_epsilon is not None else "run")
