import numpy as np
import pytest
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.compat.common.recorddict_compat import fitins_to_recorddict

from common.records import (
    FITRES_METRICS,
    ReplyError,
    check_arrays,
    from_array_record,
    read_train_instruction,
    read_train_reply,
    to_array_record,
    train_instruction,
    train_reply,
)

REF = {"layer.lora_A.weight": np.ones((2, 4), np.float32), "layer.lora_B.weight": np.zeros((4, 2), np.float32)}


def test_named_round_trip_and_positional_secagg_layout():
    arrays, config = read_train_instruction(train_instruction(REF, {"server-round": 3}), sorted(REF))
    assert config["server-round"] == 3
    for k in REF:
        np.testing.assert_array_equal(arrays[k], REF[k])
    # SecAgg+ re-packs instructions as unnamed legacy Parameters: names come back by position
    legacy = fitins_to_recorddict(FitIns(ndarrays_to_parameters([REF[k] for k in sorted(REF)]), {"x": 1}), True)
    arrays, _ = read_train_instruction(legacy, sorted(REF))
    assert sorted(arrays) == sorted(REF)
    np.testing.assert_array_equal(arrays["layer.lora_A.weight"], REF["layer.lora_A.weight"])


def test_reply_round_trip():
    arrays, n, metrics = read_train_reply(train_reply(REF, 8, {"train_loss": 1.5}), REF)
    assert n == 8 and metrics["train_loss"] == 1.5
    np.testing.assert_array_equal(arrays["layer.lora_A.weight"], REF["layer.lora_A.weight"])


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({**REF, "layer.lora_A.weight": np.full((2, 4), np.nan, np.float32)}, "NaN"),
        ({**REF, "layer.lora_B.weight": np.full((4, 2), np.inf, np.float32)}, "NaN or Inf"),
        ({**REF, "layer.lora_B.weight": np.zeros((4, 3), np.float32)}, "shape"),
        ({"layer.lora_A.weight": REF["layer.lora_A.weight"]}, "missing"),
        ({**REF, "extra": np.zeros(1, np.float32)}, "unexpected"),
    ],
)
def test_bad_replies_are_rejected_with_a_reason(bad, reason):
    with pytest.raises(ReplyError, match=reason):
        read_train_reply(train_reply(bad, 8, {}), REF)


def test_reply_missing_record_or_examples():
    content = train_reply(REF, 8, {})
    del content[FITRES_METRICS]
    with pytest.raises(ReplyError, match="lacks"):
        read_train_reply(content, REF)
    with pytest.raises(ReplyError, match="positive"):
        read_train_reply(train_reply(REF, 0, {}), REF)


def test_positional_count_mismatch_is_an_error():
    record = to_array_record({"a": np.zeros(1, np.float32)})
    with pytest.raises(ReplyError, match="expected 2 arrays"):
        from_array_record(record, ["x", "y"])
    check_arrays(REF, REF)  # the reference itself passes
