"""The server's checks on what a client sends: every bad value of a reply is refused with a reason naming it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.records import ReplyError
from common.reply_checks import (
    EVAL_METRICS,
    TRAIN_METRICS,
    TRAIN_OPTIONAL,
    ListOf,
    check_eval_metrics,
    check_metrics,
    check_update,
    check_weight,
    clip_update,
    reply_metric_specs,
    update_norm,
)

GOOD_TRAIN = {
    "train_loss": 1.5,
    "train_tokens": 120,
    "train_seconds": 2.0,
    "tokens_per_second": 60.0,
    "partition-id": 1,
}
GOOD_EVAL = {"eval_loss": 2.0, "exact_match": 0.5, "rouge_l": 0.25, "eval_examples": 8, "partition-id": 0, "model": "m"}


def test_good_metrics_pass_unchanged():
    assert check_metrics({**GOOD_TRAIN, "beta": [0.5, 0.25]}, TRAIN_METRICS) == {**GOOD_TRAIN, "beta": [0.5, 0.25]}
    assert check_metrics(GOOD_EVAL, EVAL_METRICS) == GOOD_EVAL


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("train_loss", math.nan, "train_loss"),
        ("train_loss", math.inf, "not finite"),
        ("train_loss", "low", "must be a number"),
        ("train_loss", b"\x00", "bytes"),
        ("train_loss", -1.0, "outside"),
        ("train_tokens", 1.5, "whole number"),
        ("partition-id", True, "must be a number"),
        ("beta", [0.5, math.nan], "beta"),
        ("beta", [[0.5]], "nested"),
        ("note", "x" * 5000, "5000 characters"),
        ("blob", b"abc", "bytes is not a metric"),
    ],
)
def test_a_bad_train_metric_is_refused_naming_it(key, value, says):
    with pytest.raises(ReplyError, match=says):
        check_metrics({**GOOD_TRAIN, key: value}, TRAIN_METRICS)


@pytest.mark.parametrize("missing", sorted(TRAIN_METRICS))
def test_a_missing_train_metric_is_refused(missing):
    metrics = {k: v for k, v in GOOD_TRAIN.items() if k != missing}
    with pytest.raises(ReplyError, match=f"'{missing}' is missing"):
        check_metrics(metrics, TRAIN_METRICS)


def test_eval_scores_are_fractions():
    with pytest.raises(ReplyError, match="exact_match"):
        check_metrics({**GOOD_EVAL, "exact_match": 1.5}, EVAL_METRICS)


@pytest.mark.parametrize(
    ("losses", "tokens", "says"),
    [
        ([1.0] * 7, [3] * 7, "eval_examples=8"),  # one short: it could not be paired with another run's examples
        ([1.0] * 8, [3] * 7 + [2.5], "whole"),
        ([1.0] * 7 + [-0.1], [3] * 8, "outside"),
        ([1.0] * 7 + [math.nan], [3] * 8, "finite"),
        (1.0, [3] * 8, "list"),
    ],
)
def test_per_example_losses_must_be_one_finite_value_per_example(losses, tokens, says):
    good = {**GOOD_EVAL, "eval_example_loss": [1.0] * 8, "eval_example_tokens": [3] * 8}
    assert check_eval_metrics(good) == good
    assert check_eval_metrics(GOOD_EVAL) == GOOD_EVAL  # optional: older clients send none
    with pytest.raises(ReplyError, match=says):
        check_eval_metrics({**good, "eval_example_loss": losses, "eval_example_tokens": tokens})


@pytest.mark.parametrize(
    ("value", "says"),
    [(math.inf, "finite"), (math.nan, "finite"), (0, "at least 1"), (-3, "at least 1"), (2.5, "whole"), ("9", "num")],
)
def test_a_bad_weight_is_refused(value, says):
    with pytest.raises(ReplyError, match=says):
        check_weight(value, cap=8)


def test_a_weight_above_what_the_instruction_allowed_is_capped():
    assert check_weight(8, cap=8) == (8, False)
    assert check_weight(1e12, cap=8) == (8, True)
    assert check_weight(3.0, cap=8) == (3, False)


def test_values_beyond_float32_are_refused_after_the_cast():
    start = {"w": np.zeros(3, np.float32)}
    assert np.all(np.isfinite(np.array([1e39, 0.0, 0.0])))  # fine as float64: the old check passed it
    with pytest.raises(ReplyError, match="NaN or Inf"):
        check_update({"w": np.array([1e39, 0.0, 0.0])}, start, max_norm=1e30)


def test_an_update_too_far_from_the_start_is_refused():
    start = {"a": np.ones(4, np.float32), "b": np.zeros(2, np.float32)}
    near = {"a": start["a"] + 1.0, "b": np.array([0.0, 0.0], np.float32)}  # norm 2
    assert update_norm(near, start) == pytest.approx(2.0)
    assert check_update(near, start, max_norm=2.5)["a"].dtype == np.float32
    with pytest.raises(ReplyError, match="update norm 2 exceeds"):
        check_update(near, start, max_norm=1.5)


def test_clipping_scales_the_update_to_the_norm_and_keeps_its_direction():
    start = {"a": np.ones(2, np.float32)}
    far = {"a": np.array([4.0, 5.0], np.float32)}  # update (3, 4): norm 5
    clipped, was = clip_update(far, start, clip_norm=1.0)
    assert was and update_norm(clipped, start) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(clipped["a"] - start["a"], [0.6, 0.8], rtol=1e-6)
    same, was = clip_update(far, start, clip_norm=10.0)
    assert not was and np.array_equal(same["a"], far["a"])


# The whole reply is bounded, not only each value: before, 10,000 keys of 100,000-element lists (or of 4,096-character
# strings) all passed, a reply the server then kept in memory, logged and wrote to metrics.jsonl.
@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({f"k{i}": 0.5 for i in range(300)}, "305 keys .at most 256"),
        ({"a" * 129: 1.0}, "129 characters .at most 128"),
        ({7: 1.0}, "metric name must be a string"),
        ({f"loss{i}": [0.5] * 60_000 for i in range(4)}, "more than 200000 list elements"),
        ({f"note{i}": "x" * 4_000 for i in range(251)}, "more than 1000000 characters"),
        ({f"notes{i}": ["x" * 4_000] * 100 for i in range(3)}, "more than 1000000 characters"),
    ],
)
def test_a_reply_too_large_as_a_whole_is_refused_naming_the_limit(extra, says):
    assert all(len(v) <= 100_000 for v in extra.values() if isinstance(v, list))  # each value alone is acceptable
    with pytest.raises(ReplyError, match=says):
        check_metrics({**GOOD_TRAIN, **extra}, TRAIN_METRICS)


def test_a_large_but_legitimate_reply_still_passes():
    """Per-example losses and token counts of 50,000 held-out examples, a strategy's own keys and notes."""
    n = 50_000
    good = {
        **GOOD_EVAL,
        "eval_examples": n,
        "eval_example_loss": [1.25] * n,
        "eval_example_tokens": [12] * n,
        **{f"layer{i}.beta": [0.5] * 64 for i in range(200)},
        "a" * 128: "x" * 4_096,
    }
    assert check_eval_metrics(good) == good


# the optional metrics the server reads when a reply carries them (issue: one string here stopped the whole run)
PQLORA = reply_metric_specs({"beta": float, "active_blocks": int})
VEMOE = reply_metric_specs({"vemoe_top": int, "vemoe_vote": None})


@pytest.mark.parametrize(
    ("key", "value", "specs", "says"),
    [
        ("secagg_clipped", "x", TRAIN_OPTIONAL, "secagg_clipped' must be a number"),
        ("secagg_clipped", -3, TRAIN_OPTIONAL, "outside"),
        ("secagg_norm_clipped", 2, TRAIN_OPTIONAL, "outside"),
        ("train_guard_share", 1.5, TRAIN_OPTIONAL, "outside"),
        ("beta", "0.5,x", PQLORA, "'x' is not a number"),
        ("beta", "0.5,nan", PQLORA, "not finite"),
        ("beta", 0.5, PQLORA, "must be a list"),
        ("active_blocks", "1,2.5", PQLORA, "whole number"),
        ("vemoe_top", "1e400", VEMOE, "not finite"),
        ("vemoe_vote", "8", VEMOE, "must be a number"),
    ],
)
def test_an_optional_metric_the_server_reads_is_parsed_once_or_the_reply_refused(key, value, specs, says):
    with pytest.raises(ReplyError, match=says):
        check_metrics({**GOOD_TRAIN, key: value}, TRAIN_METRICS, specs)


def test_optional_metrics_come_back_typed_and_lists_decoded_from_their_comma_joined_form():
    sent = {**GOOD_TRAIN, "beta": "0.5,0.25", "active_blocks": "0,3", "secagg_clipped": 4.0, "other": "kept as sent"}
    checked = check_metrics(sent, TRAIN_METRICS, {**TRAIN_OPTIONAL, **PQLORA})
    assert checked["beta"] == [0.5, 0.25] and checked["active_blocks"] == [0, 3]
    assert checked["secagg_clipped"] == 4 and isinstance(checked["secagg_clipped"], int)
    assert checked["other"] == "kept as sent" and isinstance(checked["train_tokens"], int)
    assert check_metrics({**GOOD_TRAIN, "active_blocks": ""}, TRAIN_METRICS, PQLORA)["active_blocks"] == []
    assert check_metrics({**GOOD_TRAIN, "vemoe_top": [1, 2]}, TRAIN_METRICS, VEMOE)["vemoe_top"] == [1, 2]
    assert PQLORA["active_blocks"] == ListOf(int)


@pytest.mark.parametrize(
    ("generated", "says"), [("x", "eval_generated"), (9, "more than eval_examples=8"), (-1, "outside")]
)
def test_an_eval_reply_generating_what_it_did_not_evaluate_is_refused(generated, says):
    with pytest.raises(ReplyError, match=says):
        check_eval_metrics({**GOOD_EVAL, "eval_generated": generated})


def test_the_update_norm_bound_is_chosen_from_the_recent_honest_medians_below_the_operators():
    from common.reply_checks import NORM_WINDOW, chosen_max_update_norm

    assert chosen_max_update_norm([], 10.0, 1e3) == 1e3  # round 1: nothing measured yet
    assert chosen_max_update_norm([5.0, 6.0, 4.0], 10.0, 1e3) == pytest.approx(50.0)
    assert chosen_max_update_norm([5.0, 6.0, 4.0], 0.0, 1e3) == 1e3  # off: the fixed bound
    assert chosen_max_update_norm([500.0], 10.0, 1e3) == 1e3  # never above the operator's
    old = [1000.0] * 10 + [2.0] * NORM_WINDOW  # only the last rounds count
    assert chosen_max_update_norm(old, 10.0, 1e3) == pytest.approx(20.0)
    assert chosen_max_update_norm([math.nan, 0.0, 3.0], 10.0, 1e3) == pytest.approx(30.0)
