"""Evaluation kept on the member's node (``client_app.kept_evaluation``): the member decides, the run may ask, the
server cannot overrule; a kept reply carries nothing measured and passes the reply checks, anything else does not."""

from __future__ import annotations

import json

import pytest

from client_app.kept_evaluation import keeps_evaluation, kept_reply
from common.records import ReplyError
from common.reply_checks import KEPT_ON_NODE, check_eval_metrics
from strategies import load_run_config


@pytest.mark.parametrize(
    ("node", "run", "kept"),
    [
        ({}, False, False),
        ({"keep-evaluation": "true"}, False, True),  # the member's own choice
        ({"keep-evaluation": True}, False, True),
        ({}, True, True),  # the run asks every member
        ({"keep-evaluation": "false"}, True, True),  # ... and a member's false cannot make it send them
        ({"keep-evaluation": " TRUE "}, False, True),
    ],
)
def test_the_member_keeps_its_evaluation_when_it_or_the_run_says_so(node, run, kept):
    assert keeps_evaluation(node, load_run_config({"eval.keep-on-node": run})) is kept


@pytest.mark.parametrize("value", ["yes", "1", 1, "secret-value"])
def test_a_node_value_that_is_not_true_or_false_is_refused_naming_the_key_not_the_value(value):
    with pytest.raises(ValueError, match="node-config keep-evaluation: expected true or false") as err:
        keeps_evaluation({"keep-evaluation": value}, load_run_config({}))
    assert "secret-value" not in str(err.value)


def test_a_kept_evaluation_is_written_on_the_node_and_its_reply_carries_nothing_measured(tmp_path):
    measured = {"eval_loss": 1.25, "exact_match": 0.5, "rouge_l": 0.4, "eval_examples": 8, "data-test": 40}
    reply = kept_reply(dict(measured), tmp_path / "client-evaluation", 3, 2)
    assert reply == {KEPT_ON_NODE: 1}
    (line,) = (tmp_path / "client-evaluation" / "partition-3.jsonl").read_text().splitlines()
    assert json.loads(line) == {"round": 2, **measured}
    kept_reply(dict(measured), tmp_path / "client-evaluation", 3, 3)  # the next round's beside it
    assert len((tmp_path / "client-evaluation" / "partition-3.jsonl").read_text().splitlines()) == 2
    assert check_eval_metrics({**reply, "partition-id": 3}, max_examples=8)[KEPT_ON_NODE] == 1


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ({KEPT_ON_NODE: 2, "partition-id": 0}, "eval_kept_on_node"),
        ({KEPT_ON_NODE: "yes", "partition-id": 0}, "eval_kept_on_node"),
        ({KEPT_ON_NODE: 1}, "partition-id"),
        ({"partition-id": 0}, "eval_loss"),  # neither measured nor kept
    ],
)
def test_a_kept_reply_is_held_to_its_own_keys(reply, message):
    with pytest.raises(ReplyError, match=message):
        check_eval_metrics(reply)
