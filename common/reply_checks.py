"""What the server accepts from a client's reply, checked before any of it is used.

A reply is the only thing a client controls on the server, so every value in it is checked where the reply is
accepted, and a bad one costs only that client's contribution to the round (``ReplyError`` with the reason):

- metrics: every value a bool, a whole number, a finite float, a short string, or a list of those (no bytes, no
  NaN/Inf); the keys the server reads (``TRAIN_METRICS``, ``EVAL_METRICS``) present, numeric and in range; and
  nothing huge: a string at most ``MAX_TEXT`` characters, a list at most ``MAX_LIST`` elements, and the reply as a
  whole (what the server keeps, logs and writes to ``metrics.jsonl``) at most ``MAX_KEYS`` names, each a string of
  at most ``MAX_KEY_TEXT`` characters, with at most ``MAX_TOTAL_ELEMENTS`` list elements and ``MAX_TOTAL_TEXT``
  characters of strings summed over all its values (per-example eval losses of tens of thousands of examples fit);
- the member's weight (``num_examples``): a finite whole number of at least 1; above what the instruction allowed
  (local steps x batch x accumulation, or the group's own maximum) it is capped, and the cap is reported;
- arrays: float32 and finite AFTER the cast (float64 values beyond float32's range become Inf), and an update whose
  L2 distance from what the client was sent exceeds ``robust.max-update-norm`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from common.records import ReplyError

MAX_TEXT = 4096  # characters in a string metric
MAX_LIST = 100_000  # elements in a list metric
# ... and in the whole reply (a client could otherwise send any number of values each within the limits above)
MAX_KEYS = 256  # metric names
MAX_KEY_TEXT = 128  # characters in a metric name
MAX_WHOLE = 2**53  # a whole-number metric: beyond this a float cannot hold it exactly (nor JSON readers)
MAX_PARTITION = 2**31 - 1  # node configs and Flower datasets index partitions with 32-bit ints
MAX_TOTAL_ELEMENTS = 200_000  # list elements, summed over every list metric
MAX_TOTAL_TEXT = 1_000_000  # characters of string values, summed over every metric and list element


class Bound(NamedTuple):
    """A metric the server reads: its kind (``float`` or ``int``) and its range (None: open)."""

    kind: type
    low: float | None = 0.0
    high: float | None = None


class ListOf(NamedTuple):
    """A metric the server reads as a list (sent as a list, or comma-joined through SecAgg+'s FitRes): the kind of
    its elements and their range (None: open)."""

    kind: type
    low: float | None = None
    high: float | None = None


Spec = Bound | ListOf

IDENTITY_METRICS = {"partition-id": Bound(int, 0, MAX_PARTITION)}
TRAIN_METRICS = {
    "train_loss": Bound(float),
    "train_tokens": Bound(int),
    "train_seconds": Bound(float),
    "tokens_per_second": Bound(float),
    **IDENTITY_METRICS,
}
EVAL_METRICS = {
    "eval_loss": Bound(float),
    "exact_match": Bound(float, 0.0, 1.0),
    "rouge_l": Bound(float, 0.0, 1.0),
    "eval_examples": Bound(int),
    **IDENTITY_METRICS,
}


PER_EXAMPLE_METRICS = ("eval_example_loss", "eval_example_tokens")  # one value per held-out example evaluated

# Metrics the server reads when a reply carries them: parsed here, once, into typed values (``check_metrics``'s
# ``optional``), so that nothing downstream converts a reply's string (a strategy's and an adapter kind's own are
# added from their ``reply_metrics``: ``reply_metric_specs``).
GUARD_BOUNDS = {"share": Bound(float, 0.0, 1.0), "server_loss": Bound(float), "own_loss": Bound(float)}
TRAIN_OPTIONAL: dict[str, Spec] = {
    "train_loss_tokens": Bound(int),  # tokens that carried a loss (common.training.train_round)
    "loss_tokens_per_second": Bound(float),
    "gpu_peak_allocated_mb": Bound(float),  # CUDA clients
    "secagg_clipped": Bound(int),
    "secagg_norm_clipped": Bound(int, 0, 1),
    "update_norm": Bound(float),  # secure mode: the member's own word (the server cannot measure one update)
    "dp_member_releases": Bound(int),  # dp.*: what the member's own ledger holds (client_app.member_ledger)
    "dp_member_releases_without_noise": Bound(int),
    "dp_member_epsilon": Bound(float),
    "dp_record_epsilon": Bound(float),
    "dp_record_target": Bound(float),
    "dp_record_delta": Bound(float, 0.0, 1.0),
    "dp_record_noise_multiplier": Bound(float),
    "dp_record_sampling_rate": Bound(float, 0.0, 1.0),
    **{f"train_guard_{k}": b for k, b in GUARD_BOUNDS.items()},
}
# dp.*: what a member's own privacy ledger holds (client_app.member_ledger), carried into its train row
MEMBER_LEDGER_METRICS = ("dp_member_releases", "dp_member_releases_without_noise", "dp_member_epsilon")
# record-level DP-SGD (client_app.record_dp): the member's epsilon spent so far, its target and delta, this round's
# noise multiplier and sampling rate; a reply that carries them need not carry its training loss and token counts
RECORD_DP_METRICS = (
    "dp_record_epsilon",
    "dp_record_target",
    "dp_record_delta",
    "dp_record_noise_multiplier",
    "dp_record_sampling_rate",
)
RECORD_DP_WITHHELD = ("train_loss", "train_tokens", "tokens_per_second")  # computed from the sampled records
EVAL_OPTIONAL: dict[str, Spec] = {"eval_generated": Bound(int), **{f"guard_{k}": b for k, b in GUARD_BOUNDS.items()}}
# An evaluation the member kept on its node (``client_app.kept_evaluation``): the reply says so and holds no measure
KEPT_ON_NODE = "eval_kept_on_node"
KEPT_EVAL_METRICS = {KEPT_ON_NODE: Bound(int, 1, 1), **IDENTITY_METRICS}


def reply_metric_specs(declared: Mapping[str, type | None]) -> dict[str, Spec]:
    """``reply_metrics`` as an adapter kind or strategy declares them (name -> list element type, or None for a
    number) as specs ``check_metrics`` parses."""
    return {k: Bound(float, None, None) if kind is None else ListOf(kind) for k, kind in declared.items()}


def check_eval_metrics(metrics: Mapping[str, Any], max_examples: int | None = None) -> dict[str, Any]:
    """An evaluation reply's metrics (``check_metrics`` with ``EVAL_METRICS``); its per-example losses and token
    counts, when sent, must be lists of ``eval_examples`` finite values >= 0 (whole numbers for the counts), since a
    comparison resamples them; ``eval_examples`` (the reply's weight in the round's mean) at most ``max_examples``,
    what the server asked for. A reply of an evaluation kept on the node carries only ``eval_kept_on_node`` = 1
    (and identity): its measures, if sent anyway, are not read."""
    if KEPT_ON_NODE in metrics:  # nothing measured was sent: nothing to weigh or resample
        return check_metrics(metrics, KEPT_EVAL_METRICS, {})
    checked = check_metrics(metrics, EVAL_METRICS, EVAL_OPTIONAL)
    n = int(checked["eval_examples"])
    if max_examples is not None and n > max_examples:
        raise ReplyError(f"metric 'eval_examples' = {n} is more than the {max_examples} examples asked for")
    if checked.get("eval_generated", 0) > n:
        raise ReplyError(f"metric 'eval_generated' = {checked['eval_generated']} is more than eval_examples={n}")
    for key in PER_EXAMPLE_METRICS:
        if key not in checked:
            continue
        values = checked[key]
        if not isinstance(values, (list, tuple)) or len(values) != n:
            raise ReplyError(f"metric '{key}': expected a list of eval_examples={n} values")
        for value in values:
            _check_bound(key, value, Bound(int if key.endswith("tokens") else float))
    return checked


@dataclass(frozen=True)
class ReplyLimits:
    """What a round's train replies are held to (from the run config; see ``server_app.training.reply_limits``).

    examples_per_round: local steps x batch x accumulation, the most examples a member can weigh by.
    max_update_norm: an update further than this (L2) from what the member was sent is refused.
    clip_norm: if set, updates further than this are scaled back to it (``robust.clip-norm``).
    train_metrics: the metrics every train reply must carry (the core ones and the strategy's own).
    private: ``dp.*``: every update is clipped to ``clip_norm`` and none is refused for its norm (the count a mean
        divides by must not depend on the data), and nothing measured on an update (its norm, whether it was
        clipped) is kept beyond the reply's check.
    """

    examples_per_round: int
    max_update_norm: float = 1e3
    clip_norm: float | None = None
    private: bool = False
    train_metrics: Mapping[str, Bound] = field(default_factory=lambda: dict(TRAIN_METRICS))
    optional_metrics: Mapping[str, Spec] = field(default_factory=lambda: dict(TRAIN_OPTIONAL))


def check_metrics(
    metrics: Mapping[str, Any], required: Mapping[str, Bound], optional: Mapping[str, Spec] | None = None
) -> dict[str, Any]:
    """``metrics`` as a plain dict if every name and value is acceptable, the reply as a whole within the limits
    (``MAX_KEYS``, ``MAX_KEY_TEXT``, ``MAX_TOTAL_ELEMENTS``, ``MAX_TOTAL_TEXT``), every required key is present
    and in range, and every ``optional`` key it carries parses as its spec. Required and optional values come back
    typed (``int`` or ``float``; a list of its kind), so that nothing downstream converts a reply's value."""
    if len(metrics) > MAX_KEYS:
        raise ReplyError(f"a reply of {len(metrics)} keys (at most {MAX_KEYS} metric names)")
    size = _Size()
    for key, value in metrics.items():
        _check_key(key)
        size.add(key, value)
        _check_value(key, value)
    checked = dict(metrics)
    if RECORD_DP_METRICS[0] in metrics:  # a member training by DP-SGD keeps what it computed from its records
        required = {k: b for k, b in required.items() if k not in RECORD_DP_WITHHELD}
    for key, bound in required.items():
        if key not in metrics:
            raise ReplyError(f"metric '{key}' is missing")
        checked[key] = parse_metric(key, metrics[key], bound)
    for key, spec in (optional or {}).items():
        if key in metrics:
            checked[key] = parse_metric(key, metrics[key], spec)
    return checked


def parse_metric(key: str, value: Any, spec: Spec) -> Any:
    """``value`` as ``spec`` reads it (a number of its kind in its range, or a list of them), else ``ReplyError``."""
    if isinstance(spec, ListOf):
        items = [x for x in value.split(",") if x.strip()] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ReplyError(f"metric '{key}' must be a list, got {type(value).__name__} {str(value)[:40]!r}")
        return [parse_metric(key, _number(key, item), Bound(spec.kind, spec.low, spec.high)) for item in items]
    _check_bound(key, value, spec)
    return int(value) if spec.kind is int else float(value)


def _number(key: str, text: Any) -> Any:
    """A comma-joined list's element as a number (already a number: itself)."""
    if not isinstance(text, str):
        return text
    try:
        number = float(text)
    except ValueError:
        raise ReplyError(f"metric '{key}': {text.strip()[:40]!r} is not a number") from None
    if not math.isfinite(number):
        raise ReplyError(f"metric '{key}': {text.strip()[:40]} is not finite")
    return number


def _check_key(key: Any) -> None:
    if not isinstance(key, str):
        raise ReplyError(f"metric name must be a string, got {type(key).__name__} {str(key)[:40]!r}")
    if len(key) > MAX_KEY_TEXT:
        raise ReplyError(f"metric name {key[:40]!r}...: {len(key)} characters (at most {MAX_KEY_TEXT})")


class _Size:
    """The list elements and string characters of a reply so far, refused as soon as either exceeds its limit (before
    the value's elements are checked one by one)."""

    def __init__(self) -> None:
        self.elements = 0
        self.text = 0

    def add(self, key: str, value: Any) -> None:
        if isinstance(value, (list, tuple)):
            self.elements += len(value)
            if self.elements > MAX_TOTAL_ELEMENTS:
                raise ReplyError(
                    f"metric '{key}': the reply has more than {MAX_TOTAL_ELEMENTS} list elements in all "
                    f"(MAX_TOTAL_ELEMENTS)"
                )
            self.text += sum(len(e) for e in value if isinstance(e, str))
        elif isinstance(value, str):
            self.text += len(value)
        if self.text > MAX_TOTAL_TEXT:
            raise ReplyError(
                f"metric '{key}': the reply has more than {MAX_TOTAL_TEXT} characters of strings in all "
                f"(MAX_TOTAL_TEXT)"
            )


def _check_value(key: str, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_LIST:
            raise ReplyError(f"metric '{key}': a list of {len(value)} elements (at most {MAX_LIST})")
        for element in value:
            if isinstance(element, (list, tuple)):
                raise ReplyError(f"metric '{key}': nested lists are not metrics")
            _check_value(key, element)
    elif isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise ReplyError(f"metric '{key}': a string of {len(value)} characters (at most {MAX_TEXT})")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ReplyError(f"metric '{key}': {value} is not finite")
    elif not isinstance(value, (bool, int)):  # bytes, None, objects
        raise ReplyError(f"metric '{key}': a {type(value).__name__} is not a metric value")


def _check_bound(key: str, value: Any, bound: Bound) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyError(f"metric '{key}' must be a number, got {type(value).__name__} {str(value)[:40]!r}")
    if bound.kind is int and not float(value).is_integer():
        raise ReplyError(f"metric '{key}' must be a whole number, got {value:.6g}")
    if bound.kind is int and abs(value) > MAX_WHOLE:
        raise ReplyError(f"metric '{key}' = {value:.6g} is beyond what a whole-number metric can hold (2^53)")
    if (bound.low is not None and value < bound.low) or (bound.high is not None and value > bound.high):
        raise ReplyError(f"metric '{key}' = {value:.6g} is outside [{bound.low}, {bound.high}]")


def check_weight(value: Any, cap: float) -> tuple[int, bool]:
    """A member's ``num_examples``: (the weight to use, whether it was capped at ``cap``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyError(f"num_examples must be a number, got {type(value).__name__} {str(value)[:40]!r}")
    if not math.isfinite(value) or not float(value).is_integer():
        raise ReplyError(f"num_examples must be a finite whole number, got {value}")
    if value < 1:
        raise ReplyError(f"num_examples must be at least 1, got {int(value)}")
    if value > cap:
        return int(cap), True
    return int(value), False


def check_update(
    arrays: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], max_norm: float
) -> dict[str, np.ndarray]:
    """The arrays as float32, refused if a value is not finite after the cast or if their L2 distance from
    ``start`` (what the member was sent, same names) exceeds ``max_norm``."""
    with np.errstate(over="ignore"):  # values beyond float32 become Inf, refused just below
        cast = {k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}
    for key, value in cast.items():
        if not np.all(np.isfinite(value)):
            raise ReplyError(f"{key}: NaN or Inf (as float32)")
    norm = update_norm(cast, start)
    if norm > max_norm:
        raise ReplyError(f"update norm {norm:.3g} exceeds robust.max-update-norm={max_norm:g}")
    return cast


def update_norm(arrays: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of ``arrays - start`` over every array (float64 sums: no overflow for float32 inputs)."""
    total = sum(float(np.sum((arrays[k].astype(np.float64) - start[k]) ** 2)) for k in arrays)
    return math.sqrt(total)


def clip_update(
    arrays: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], clip_norm: float
) -> tuple[dict[str, np.ndarray], bool]:
    """``start + (arrays - start)`` scaled so that its norm is at most ``clip_norm``; whether it was scaled."""
    norm = update_norm(arrays, start)
    if norm <= clip_norm:
        return dict(arrays), False
    scale = clip_norm / norm
    return {k: (start[k] + (arrays[k] - start[k]) * scale).astype(np.float32) for k in arrays}, True


def masked_weight_problem(
    unmasked_total: int, reported: Mapping[int, int], max_weight: float, quantization_range: int, modulus: int
) -> str | None:
    """Why SecAgg+'s unmasked total weight disagrees with the members' weights reported in the clear (None if not).

    Each member of Flower's SecAgg+ scales its update by ``q = round(num_examples / max_weight * quantization_range)``
    and masks ``q`` with it; the server unmasks ``sum(q) mod modulus`` and divides the summed update by it. The same
    ``q`` recomputed from each member's reported ``num_examples`` must give the same sum, exactly: a member that
    masked another weight than it reported (or one beyond ``max_weight``, which wraps the modulus) would otherwise
    steer the mean unseen."""
    expected = sum(round(n / max_weight * quantization_range) for n in reported.values()) % modulus
    if int(unmasked_total) == expected:
        return None
    masked = int(unmasked_total) / quantization_range * max_weight
    return (
        f"the members' masked weights sum to {masked:.6g} but their reported num_examples to "
        f"{sum(reported.values())}: a member weighted its update by another num_examples than it reported"
    )


NORM_WINDOW = 5  # rounds of honest update norms the chosen bound looks back over


def chosen_max_update_norm(medians: Sequence[float], multiple: float, ceiling: float) -> float:
    """The round's ``robust.max-update-norm``: ``multiple`` x the median of the last ``NORM_WINDOW`` rounds' median
    accepted update norm, never above ``ceiling`` (the operator's bound); ``ceiling`` before any round measured one
    or with ``multiple`` 0. A median is over the members, so a hostile minority cannot raise it much."""
    seen = [m for m in medians[-NORM_WINDOW:] if math.isfinite(m) and m > 0]
    if not multiple or not seen:
        return ceiling
    return min(ceiling, multiple * float(np.median(seen)))
