"""Adapters and metrics <-> Flower records: the wire format, shared by the ServerApp and the ClientApp.

Train messages use Flower's legacy FitIns / FitRes layout (``fitins.parameters``, ``fitres.num_examples``, ...)
because that is what ``secaggplus_mod`` masks; the arrays inside are NAMED (peft's adapter keys, sorted), so
plain-mode replies can be checked key by key. When SecAgg+ re-packs instructions it drops the names, so the
client maps arrays positionally onto its own sorted names after checking the count and shapes.
Adapters travel as float32; every message's array bytes are counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

FITINS_ARRAYS, FITINS_CONFIG = "fitins.parameters", "fitins.config"
FITRES_ARRAYS, FITRES_METRICS = "fitres.parameters", "fitres.metrics"
FITRES_NUM_EXAMPLES, FITRES_STATUS = "fitres.num_examples", "fitres.status"
ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"


class ReplyError(ValueError):
    """A client reply that cannot be used (missing key, wrong shape, NaN/Inf, ...)."""


def num_bytes(arrays: dict[str, np.ndarray]) -> int:
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def to_array_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(arrays[k], dtype=np.float32)) for k in sorted(arrays)})


def from_array_record(record: ArrayRecord, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Named arrays from a record; with ``names``, positional records (SecAgg+ re-packed) are mapped onto them."""
    from flwr.common import bytes_to_ndarray

    # Arrays re-packed from legacy Parameters carry no shape/dtype, only np.save bytes: decode those bytes.
    values = {k: bytes_to_ndarray(v.data) if not v.shape else v.numpy() for k, v in record.items()}
    if names is None or set(values) == set(names):
        return values
    if len(values) != len(names):
        raise ReplyError(f"expected {len(names)} arrays, got {len(values)}")
    return dict(zip(names, values.values()))


def train_instruction(arrays: dict[str, np.ndarray], config: dict[str, Any]) -> RecordDict:
    return RecordDict({FITINS_ARRAYS: to_array_record(arrays), FITINS_CONFIG: ConfigRecord(config)})


def read_train_instruction(content: RecordDict, names: list[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    return from_array_record(content.array_records[FITINS_ARRAYS], names), dict(content.config_records[FITINS_CONFIG])


def train_reply(arrays: dict[str, np.ndarray], num_examples: int, metrics: dict[str, Any]) -> RecordDict:
    return RecordDict(
        {
            FITRES_ARRAYS: to_array_record(arrays),
            FITRES_NUM_EXAMPLES: MetricRecord({"num_examples": int(num_examples)}),
            FITRES_METRICS: ConfigRecord(metrics),
            FITRES_STATUS: ConfigRecord({"code": 0, "message": "ok"}),
        }
    )


def check_arrays(arrays: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    """Raise ReplyError unless ``arrays`` has exactly the reference's keys and shapes and only finite values."""
    missing, extra = sorted(set(reference) - set(arrays)), sorted(set(arrays) - set(reference))
    if missing or extra:
        raise ReplyError(f"keys differ from the adapter: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}")
    for key, ref in reference.items():
        if arrays[key].shape != ref.shape:
            raise ReplyError(f"{key}: shape {arrays[key].shape} != {ref.shape}")
        if not np.all(np.isfinite(arrays[key])):
            raise ReplyError(f"{key}: contains NaN or Inf")


def read_train_reply(content: RecordDict, reference: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int, dict[str, Any]]:
    """Decode and validate a plain-mode train reply against the arrays that were sent."""
    for key in (FITRES_ARRAYS, FITRES_NUM_EXAMPLES, FITRES_METRICS):
        if key not in content:
            raise ReplyError(f"reply lacks '{key}'")
    arrays = from_array_record(content.array_records[FITRES_ARRAYS])
    check_arrays(arrays, reference)
    num_examples = int(content.metric_records[FITRES_NUM_EXAMPLES]["num_examples"])
    if num_examples <= 0:
        raise ReplyError(f"num_examples must be positive, got {num_examples}")
    return arrays, num_examples, dict(content.config_records[FITRES_METRICS])


def eval_instruction(arrays: dict[str, np.ndarray], config: dict[str, Any]) -> RecordDict:
    return RecordDict({ARRAYS: to_array_record(arrays), CONFIG: ConfigRecord(config)})


def metrics_reply(metrics: dict[str, Any]) -> RecordDict:
    return RecordDict({METRICS: ConfigRecord(metrics)})


def read_metrics(content: RecordDict) -> dict[str, Any]:
    if METRICS not in content:
        raise ReplyError(f"reply lacks '{METRICS}'")
    return dict(content.config_records[METRICS])
