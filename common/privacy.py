"""Member-level differential privacy of what leaves a node: the math, as plain functions (NumPy in, NumPy out).

What is protected: one member's whole contribution to a round (zero-out adjacency: the released group sums with
a member's update against the same sums with its update replaced by none at all; Kairouz et al., "Practical and
Private (Deep) Learning without Sampling or Shuffling", ICML 2021). Each member clips its update (what it sends
minus what it was sent) to L2 norm ``C`` = ``dp.clip-norm``, so one member moves a group's sum by at most ``C``;
every released group sum carries Gaussian noise of standard deviation ``z C`` per coordinate (``z``: the noise
multiplier). A member is in one group a round (the groups of a round are disjoint), so a round is one Gaussian
mechanism of sensitivity ``C`` for that member, and ``rounds`` of them compose (``epsilon_spent``).

- ``central`` (plain mode): the server, trusted with the updates, adds N(0, (z C)^2) to each group's sum.
- ``distributed`` (SecAgg+): each member adds its share N(0, (z C)^2 / m) before masking, ``m`` the fewest members
  a group's sum can be unmasked with (``fewest_members``); whoever drops out, the unmasked sum carries at least
  the full noise. SecAgg+ then clamps each value to +-``secagg.clipping-range`` and rounds it stochastically to
  its grid (``quantisation_problem`` holds both far below the noise); the guarantee is stated for the Gaussian
  mechanism, the discrete rounding around it is unbiased and only adds variance.

No amplification by sampling is claimed: a round's sample is drawn from the run's seed and the server sees who
trains, so it is no secret (docs/privacy.md).
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from common.secure_bounds import MIN_SECURE_GROUP  # a group's sum is never unmasked from fewer members

Arrays = dict[str, np.ndarray]

# the most noise a run may plan: beyond it every coordinate of the mean is noise for any federation we run
MAX_NOISE_MULTIPLIER = 1e4
# a high-probability bound on a Gaussian vector's norm: ||g|| <= sigma (sqrt(D) + TAIL) with probability at least
# 1 - exp(-TAIL^2 / 2) (Lipschitz concentration), 1 - 1.3e-14 at 8
TAIL = 8.0


def epsilon_of(noise_multipliers: Sequence[float], delta: float) -> float:
    """The epsilon at ``delta`` of one Gaussian mechanism per round, of these noise multipliers (z), composed:
    dp-accounting's Renyi DP accountant (Mironov 2017; what Opacus and TensorFlow Privacy report), an upper bound
    for every z (tests: at most 10 % above the exact value, Balle and Wang's analytic Gaussian); 0 for no round, inf
    if a round had no noise."""
    if not noise_multipliers:
        return 0.0
    if min(noise_multipliers) <= 0:
        return math.inf
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    for z, rounds in Counter(noise_multipliers).items():
        accountant.compose(dp_accounting.GaussianDpEvent(z), rounds)
    return float(accountant.get_epsilon(delta))


def epsilon_spent(noise_multiplier: float, rounds: int, delta: float) -> float:
    """``epsilon_of`` ``rounds`` rounds of the same noise multiplier."""
    return epsilon_of([noise_multiplier] * rounds, delta)


@lru_cache(maxsize=64)  # a run asks for its z at every check and round; the answer depends on these three alone
def noise_for_target(target_epsilon: float, delta: float, rounds: int) -> float:
    """The least noise multiplier whose ``rounds`` rounds spend at most ``target_epsilon`` at ``delta``
    (dp-accounting's calibration; ValueError when even ``MAX_NOISE_MULTIPLIER`` cannot)."""
    import dp_accounting

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds)

    if epsilon_spent(MAX_NOISE_MULTIPLIER, rounds, delta) > target_epsilon:
        raise ValueError(
            f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} keeps {rounds} rounds within epsilon "
            f"{target_epsilon:g} at delta {delta:g}"
        )
    return least_noise(event, target_epsilon, delta, lowest=1e-3)


def least_noise(event_of: Callable[[float], Any], target_epsilon: float, delta: float, lowest: float) -> float:
    """The least noise multiplier z (searched from ``lowest`` up, to a relative 1e-4) whose ``event_of(z)`` (a
    dp-accounting ``DpEvent``) spends at most ``target_epsilon`` at ``delta``: dp-accounting's calibration with its
    Renyi DP accountant, which returns a z that meets the target. The caller checks first that some z can."""
    import dp_accounting

    z = dp_accounting.calibrate_dp_mechanism(
        dp_accounting.rdp.RdpAccountant,
        event_of,
        target_epsilon,
        delta,
        dp_accounting.LowerEndpointAndGuess(lowest, 1.0),
        tol=1e-4,
    )
    return float(z)


def with_noise(arrays: Mapping[str, np.ndarray], std: float, rng: np.random.Generator | None = None) -> Arrays:
    """``arrays`` plus independent N(0, std^2) per coordinate, from a generator nobody else can re-create (OS
    entropy) unless one is given (tests)."""
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    out = {}
    for key, value in arrays.items():
        noisy = np.asarray(value, np.float64) + rng.normal(0.0, std, size=np.shape(value))
        out[key] = noisy.astype(np.float32)
    return out


def fewest_members(group_size: int, reconstruction_threshold: int) -> int:
    """The fewest members whose masked vectors a group's SecAgg+ sum can hold: it is unmasked only when at least
    the reconstruction threshold of them (and never fewer than 3) survive."""
    return max(MIN_SECURE_GROUP, min(group_size, reconstruction_threshold))


def share_std(noise_multiplier: float, clip_norm: float, fewest: int) -> float:
    """A member's share of the noise in distributed mode: m shares of N(0, (z C)^2 / m) sum to N(0, (z C)^2)."""
    return noise_multiplier * clip_norm / math.sqrt(fewest)


def sum_std(noise_multiplier: float, clip_norm: float) -> float:
    """The noise a released group sum carries per coordinate (at least this much in distributed mode)."""
    return noise_multiplier * clip_norm


def noise_norm_bound(std_per_coordinate: float, dimension: int) -> float:
    """A bound the norm of ``dimension`` independent N(0, std^2) values stays under but with probability
    exp(-TAIL^2 / 2): what noise may add to an honest group's distance from its start."""
    return std_per_coordinate * (math.sqrt(dimension) + TAIL)


def grid_problem(share: float, clipping_range: float, quantization_range: int) -> str | None:
    """Why SecAgg+'s rounding grid (step 2 clipping_range / quantization_range) is too coarse for a member's noise
    of std ``share`` (it must be 1,000 grid steps wide), or None."""
    step = 2.0 * clipping_range / quantization_range
    if share >= 1000 * step:
        return None
    return (
        f"secagg.quantization-range: a member's noise (std {share:.3g}) is less than 1,000 of SecAgg+'s grid "
        f"steps ({step:.3g}); raise the quantisation range or the noise"
    )


def clamp_problem(share: float, clip_norm: float, clipping_range: float) -> str | None:
    """Why SecAgg+'s clamp to +-clipping_range would cut the tail of a member's noise of std ``share``, or None: the
    noise must stand TAIL standard deviations inside the range from an update of ``clip_norm`` (taken as the
    largest value a coordinate can reach)."""
    if clip_norm + TAIL * share <= clipping_range:
        return None
    return (
        f"secagg.clipping-range: {clipping_range:g} would clamp a member's noise (std {share:.3g}) on top of an "
        f"update of norm {clip_norm:g}; it must be at least {clip_norm + TAIL * share:.3g}"
    )


def quantisation_problem(share: float, clip_norm: float, clipping_range: float, quantization_range: int) -> str | None:
    """Why SecAgg+'s clamping or rounding would change distributed noise of per-member ``share``, or None
    (``grid_problem``, then ``clamp_problem``)."""
    return grid_problem(share, clipping_range, quantization_range) or clamp_problem(share, clip_norm, clipping_range)
