"""A SuperNode's node config as one typed section (``common.node_config``): every key it may set read into
``NodeSettings`` with its default, every bad value refused naming the key and never the value (a member's paths
and budgets are its own), a misspelt data key refused, a strategy's own key left to it."""

from __future__ import annotations

import pytest

from common.node_config import NodeConfigError, NodeSettings, node_settings

SECRET = "/home/member/secret-value"
BAD = {
    "partition-id": [-1, 1.5, "3", True],
    "num-partitions": [0, "2", False],
    "model": ["", 5],
    "data-path": ["", "  ", 3],
    "data-format": [""],
    "data-test-path": [""],
    "allow-run-config-paths": ["yes", 1, SECRET],
    "keep-evaluation": ["1", 1, SECRET],
    "max-micro-batch": [0, 2.5, "4", True],
    "audit-dir": [""],
    "worker": ["sometimes"],
    "worker-idle-timeout": [0, -5, "never", float("nan")],
    "dp-record-epsilon": [0, -1.0, SECRET, float("inf"), True],
    "dp-record-delta": [0, 1.0, SECRET],
    "dp-record-clip": [0, SECRET],
    "dp-record-noise-multiplier": [-0.1, 1e4, SECRET],
}


def test_every_key_a_node_may_set_is_a_field_with_its_default():
    keys = {field.alias for field in NodeSettings.model_fields.values()}
    assert keys == set(BAD) | {"state-dir"}
    plain = node_settings({})
    assert (plain.partition_id, plain.num_partitions, plain.worker, plain.max_micro_batch) == (0, 1, "auto", None)
    node = node_settings({"partition-id": 3, "num-partitions": 4, "keep-evaluation": "True", "dp-record-delta": "1e-5"})
    assert (node.partition_id, node.keep_evaluation, node.dp_record_delta) == (3, True, 1e-5)


@pytest.mark.parametrize("key", sorted(BAD))
def test_every_bad_value_is_refused_naming_the_key_not_the_value(key):
    for value in BAD[key]:
        with pytest.raises(NodeConfigError, match=f"^node-config {key}: ") as err:
            node_settings({key: value})
        assert SECRET not in str(err.value)


def test_a_misspelt_data_key_is_refused_and_a_strategys_own_key_is_left_to_it():
    with pytest.raises(NodeConfigError, match=r"unknown key\(s\) \['data-paht'\]"):
        node_settings({"data-paht": "/data/mine.jsonl"})
    assert node_settings({"memory-mb": 2.5}).model_extra == {"memory-mb": 2.5}  # ATLAS's: its section reads it
