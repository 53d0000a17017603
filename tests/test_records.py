import numpy as np
import pytest
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.compat.common.recorddict_compat import fitins_to_recorddict

from common.messages import RoundPart, read_train
from common.records import (
    FITINS_ARRAYS,
    FITRES_METRICS,
    ReplyError,
    check_arrays,
    from_array_record,
    pack,
    read_train_instruction,
    read_train_reply,
    to_array_record,
    train_instruction,
    train_reply,
    unpack,
)

REF = {"layer.lora_A.weight": np.ones((2, 4), np.float32), "layer.lora_B.weight": np.zeros((4, 2), np.float32)}


def test_packed_round_trip_and_positional_secagg_layout():
    content = train_instruction(REF, RoundPart(server_round=3).wire())
    (key,) = content.array_records[FITINS_ARRAYS].keys()
    assert key.startswith("packed:")  # one Array on the wire, not one per adapter matrix
    arrays, config = read_train_instruction(content, REF)
    assert read_train(config, None).round.server_round == 3
    for k in REF:
        np.testing.assert_array_equal(arrays[k], REF[k])
    # SecAgg+ re-packs instructions as unnamed legacy Parameters: the one vector is unpacked by position
    legacy = fitins_to_recorddict(FitIns(ndarrays_to_parameters([pack(REF)]), {"x": 1}), True)
    arrays, _ = read_train_instruction(legacy, REF)
    assert sorted(arrays) == sorted(REF)
    np.testing.assert_array_equal(arrays["layer.lora_A.weight"], REF["layer.lora_A.weight"])
    # and named legacy arrays (one per matrix) still map by position
    legacy = fitins_to_recorddict(FitIns(ndarrays_to_parameters([REF[k] for k in sorted(REF)]), {"x": 1}), True)
    np.testing.assert_array_equal(
        read_train_instruction(legacy, REF)[0]["layer.lora_B.weight"], REF["layer.lora_B.weight"]
    )


def test_pack_unpack_is_exact_and_checks_the_size():
    rng = np.random.default_rng(0)
    arrays = {
        "b": rng.normal(size=(3, 2)).astype(np.float32),
        "a": rng.normal(size=(4,)).astype(np.float32),
        "c": np.float32(0.5) * np.ones(()),
    }
    vector = pack(arrays)
    assert vector.shape == (11,) and vector.dtype == np.float32
    np.testing.assert_array_equal(vector[:4], arrays["a"])  # sorted-name order
    back = unpack(vector, arrays)
    assert all(back[k].shape == np.shape(arrays[k]) and np.array_equal(back[k], arrays[k]) for k in arrays)
    with pytest.raises(ReplyError, match="10 numbers, expected 11"):
        unpack(vector[:10], arrays)


def test_reply_round_trip():
    arrays, n, metrics = read_train_reply(train_reply(REF, 8, {"train_loss": 1.5}), REF)
    assert n == 8 and metrics["train_loss"] == 1.5
    np.testing.assert_array_equal(arrays["layer.lora_A.weight"], REF["layer.lora_A.weight"])


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({**REF, "layer.lora_A.weight": np.full((2, 4), np.nan, np.float32)}, "NaN"),
        ({**REF, "layer.lora_B.weight": np.full((4, 2), np.inf, np.float32)}, "NaN or Inf"),
        ({**REF, "layer.lora_B.weight": np.zeros((4, 3), np.float32)}, "layout"),
        ({**REF, "layer.lora_B.weight": np.zeros((2, 4), np.float32)}, "layout"),  # same size, other shape
        ({"layer.lora_A.weight": REF["layer.lora_A.weight"]}, "layout"),
        ({**REF, "extra": np.zeros(1, np.float32)}, "layout"),
    ],
)
def test_bad_replies_are_rejected_with_a_reason(bad, reason):
    with pytest.raises(ReplyError, match=reason):
        read_train_reply(train_reply(bad, 8, {}), REF)


def test_reply_missing_record():
    content = train_reply(REF, 8, {})
    del content[FITRES_METRICS]
    with pytest.raises(ReplyError, match="lacks"):
        read_train_reply(content, REF)
    # num_examples comes back as sent: the server checks it (tests/test_reply_checks.py)
    assert read_train_reply(train_reply(REF, 0, {}), REF)[1] == 0


def test_positional_count_mismatch_is_an_error():
    record = to_array_record({"a": np.zeros(1, np.float32), "b": np.zeros(1, np.float32), "c": np.zeros(1, np.float32)})
    with pytest.raises(ReplyError, match="expected 2 arrays"):
        from_array_record(record, REF)
    with pytest.raises(ReplyError, match="1 numbers, expected 16"):  # a lone vector of the wrong size
        from_array_record(to_array_record({"0": np.zeros(1, np.float32)}), REF)
    with pytest.raises(ReplyError, match="needs the expected names"):
        from_array_record(to_array_record(REF, packed=True))
    check_arrays(REF, REF)  # the reference itself passes
