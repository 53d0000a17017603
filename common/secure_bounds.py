"""What the server can still check about a SecAgg+ group without seeing one member's update (pure NumPy).

SecAgg+ has no range proof: a member may mask any integers it likes, and after unmasking the server holds only the
members' sum. What an honest group's sum must satisfy, it can still check:

- shape (``masked_vector_problem``): every masked reply is the factor and one packed vector, of the group's length,
  of integers in [0, modulus). Flower adds the replies with ``+`` (a short one raises, a (1,) one broadcasts), so
  this runs on each reply before Flower sees it; a failing member is treated as dropped out.
- size (``reconstruction_threshold``): the protocol itself never lets fewer than ``MIN_SECURE_GROUP`` members
  finish (Flower's default threshold for 3 members is 2: the two survivors would each learn the other's update).
- box (``box_problem``): an honest member quantises each weighted value into [0, quantization_range] (Flower clamps
  it to +-clipping range first), so each coordinate of the unmasked sum of n contributors lies in
  [0, n * quantization_range]; anything else holds a value no honest member can send.
- distance (``distance_problem``): honest members clip their own update to L2 norm ``norm`` before masking
  (``client_app.handlers``), so the group's mean is within ``norm`` (plus the quantisation error) of the same
  weighted mean of the members' starts, clamped as SecAgg+ clamps: clamping is a projection, it never lengthens a
  difference.

A hostile member can still move its group's mean anywhere inside both bounds; closing that needs zero-knowledge range
proofs (RoFL, EIFFeL, ELSA), which Flower's SecAgg+ does not have (docs/reliability-security.md).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

import numpy as np

MIN_SECURE_GROUP = 3  # SecAgg+ among 2 leaks each member's update to the other; among 1 it is the update itself


def flower_shares_and_threshold(size: int, num_shares: float, threshold: float) -> tuple[int, int]:
    """The share count and reconstruction threshold Flower's ``SecAggPlusWorkflow`` derives for a group of ``size``
    (a value <= 1 is a fraction, above 1 a count), as its setup stage computes them."""
    if num_shares <= 1:
        shares = round(num_shares * size)
        if shares < size and shares % 2 == 0:
            shares += 1
        if shares <= 2:
            shares = size
    else:
        shares = int(num_shares)
    needed = max(round(threshold * shares), 2) if threshold <= 1 else int(threshold)
    return shares, needed


def reconstruction_threshold(size: int, num_shares: float, threshold: float) -> int:
    """The threshold to give Flower for a group of ``size``: its own, raised to ``MIN_SECURE_GROUP``.

    Flower halts a group once a member has fewer neighbours still connected (itself included) than the threshold,
    and cannot remove a dropped member's masks with fewer shares; so at ``MIN_SECURE_GROUP`` no group finishes with
    fewer."""
    return max(flower_shares_and_threshold(size, num_shares, threshold)[1], MIN_SECURE_GROUP)


def masked_vector_problem(payload: Sequence[bytes], length: int, modulus: int) -> str | None:
    """Why one member's masked reply (Flower's list of serialised arrays) cannot be summed, or None: it must be two
    arrays, the weight factor of shape (1,) and the packed update of ``length``, signed integers in [0, modulus)."""
    if not isinstance(payload, (list, tuple)) or len(payload) != 2:
        count = len(payload) if isinstance(payload, (list, tuple)) else type(payload).__name__
        return f"masked reply holds {count} arrays, expected 2 (the weight factor and the packed update)"
    for index, (blob, shape) in enumerate(zip(payload, [(1,), (length,)])):
        if not isinstance(blob, bytes):
            return f"masked array {index} is a {type(blob).__name__}, not serialised bytes"
        try:
            array = np.load(io.BytesIO(blob), allow_pickle=False)
        except Exception as err:  # whatever the bytes are, they are not an array we can add
            return f"masked array {index} cannot be read: {err!r}"[:300]
        if not isinstance(array, np.ndarray) or array.shape != shape:
            return f"masked array {index} has shape {getattr(array, 'shape', None)}, expected {shape}"
        if not np.issubdtype(array.dtype, np.signedinteger) or array.dtype.itemsize > 8:
            return f"masked array {index} has dtype {array.dtype}, expected signed integers"
        if array.size and (int(array.min()) < 0 or int(array.max()) >= modulus):
            return f"masked array {index} holds values outside [0, {modulus})"
    return None


def box_problem(sums: np.ndarray, contributors: int, quantization_range: int) -> str | None:
    """Why the unmasked integer sum (before dequantisation) cannot come from ``contributors`` honest members, each
    of whose coordinates lies in [0, quantization_range]; None if every coordinate is inside that box."""
    sums = np.asarray(sums)
    high = contributors * quantization_range
    outside = int(np.count_nonzero((sums < 0) | (sums > high)))
    if outside == 0:
        return None
    return (
        f"{outside} of {sums.size} coordinates of the unmasked sum lie outside what {contributors} members inside "
        f"SecAgg+'s clipping range can send: a member masked out-of-range values"
    )


def secure_error_l2(dimension: int, contributors: int, ratio_sum: float, clipping_range: float, q_range: int) -> float:
    """An L2 bound on SecAgg+'s quantisation error of a group mean over ``dimension`` coordinates: each member's
    stochastic rounding errs by under one step (2 clipping_range / q_range) per coordinate, and the sum is divided by
    the members' summed weight ratios."""
    step = 2.0 * clipping_range / q_range
    return math.sqrt(dimension) * contributors * step / ratio_sum


def distance_problem(
    mean: Mapping[str, np.ndarray],
    starts: Sequence[Mapping[str, np.ndarray]],
    ratios: Sequence[float],
    norm: float,
    clipping_range: float,
    quantization_range: int,
) -> str | None:
    """Why a secure group's mean is further from its members' starts than honest members can take it, or None.

    ``ratios``: each contributor's weight ratio as SecAgg+ applied it (its quantised num_examples / max_weight);
    ``starts``: what each contributor was sent (the names it returns). Honest members' updates have L2 norm at most
    ``norm`` (they clip), SecAgg+ clamps r_i x_i to +-clipping_range (a projection, 1-Lipschitz), so
    || sum_i clamp(r_i x_i) - sum_i clamp(r_i s_i) || <= sum_i r_i norm: the mean is within ``norm`` of
    sum_i clamp(r_i s_i) / sum_i r_i, plus the quantisation error (``secure_error_l2``)."""
    total = float(sum(ratios))
    squared = 0.0
    for key, value in mean.items():
        reference = sum(
            np.clip(r * np.asarray(s[key], np.float64), -clipping_range, clipping_range) for r, s in zip(ratios, starts)
        )
        squared += float(np.sum((np.asarray(value, np.float64) - reference / total) ** 2))
    distance = math.sqrt(squared)
    dimension = sum(int(np.size(v)) for v in mean.values())
    bound = norm + secure_error_l2(dimension, len(ratios), total, clipping_range, quantization_range)
    if distance <= bound:
        return None
    return (
        f"the group mean is {distance:.4g} (L2) from its members' starts, beyond the {bound:.4g} that members "
        f"clipped to robust.max-update-norm / clip-norm can reach"
    )
