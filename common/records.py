"""Adapters and metrics <-> Flower records: the wire format, shared by the ServerApp and the ClientApp.

Train messages use Flower's legacy FitIns / FitRes layout (``fitins.parameters``, ``fitres.num_examples``, ...)
because that is what ``secaggplus_mod`` masks. Adapters that go back and forth every round (train instructions
and replies, evaluate instructions) travel PACKED: one float32 vector, the arrays concatenated in sorted-name
order, under the key ``packed:<layout digest>``. Flower moves every Array as its own object (one HTTP request
each between SuperLink, SuperNode and ClientApp; a LoRA adapter is 120 arrays, 244 objects), so packing is what
makes a deployed round cheap. The receiver unpacks with the layout it expects (its own adapter, or what the
server sent) and the digest catches a different layout. When SecAgg+ re-packs instructions it drops the keys, so
a lone vector is unpacked positionally after a size check. The initial adapter (once per client) travels named:
the server learns names and shapes from it. Adapters travel as float32; every message's array bytes are counted.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from .messages import ADAPTER_DIGEST, QueryPart, ReplyError, RoundPart, encode, joined

__all__ = ["ReplyError"]  # re-exported: every reply check raises it

FITINS_ARRAYS, FITINS_CONFIG = "fitins.parameters", "fitins.config"
FITRES_ARRAYS, FITRES_METRICS = "fitres.parameters", "fitres.metrics"
FITRES_NUM_EXAMPLES, FITRES_STATUS = "fitres.num_examples", "fitres.status"
ARRAYS, CONFIG, METRICS, REPORT = "arrays", "config", "metrics", "report"
PACKED = "packed"


def num_bytes(arrays: dict[str, np.ndarray]) -> int:
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def layout_digest(arrays: dict[str, np.ndarray]) -> str:
    """A short fingerprint of the names and shapes, in the order ``pack`` concatenates them."""
    layout = ";".join(f"{k}:{tuple(np.shape(arrays[k]))}" for k in sorted(arrays))
    return hashlib.sha1(layout.encode()).hexdigest()[:16]


def pack(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """One float32 vector: the arrays flattened and concatenated in sorted-name order."""
    if not arrays:
        return np.zeros(0, np.float32)
    return np.concatenate([np.asarray(arrays[k], dtype=np.float32).ravel() for k in sorted(arrays)])


def _sizes(reference: dict[str, np.ndarray]) -> list[int]:
    return [int(np.prod(np.shape(reference[k]), dtype=np.int64)) for k in sorted(reference)]


def unpack(vector: np.ndarray, reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of ``pack`` for the names and shapes of ``reference``."""
    sizes = _sizes(reference)
    vector = np.asarray(vector).ravel()
    if vector.size != sum(sizes):
        raise ReplyError(f"packed adapter has {vector.size} numbers, expected {sum(sizes)} ({len(sizes)} arrays)")
    pieces = np.split(vector.astype(np.float32, copy=False), np.cumsum(sizes)[:-1])
    return {k: piece.reshape(np.shape(reference[k])) for k, piece in zip(sorted(reference), pieces)}


def to_array_record(arrays: dict[str, np.ndarray], packed: bool = False) -> ArrayRecord:
    """Named arrays, or with ``packed`` one vector under ``packed:<layout digest>`` (see the module docstring); no
    arrays (a strategy that sends none): an empty record."""
    if packed and arrays:
        return ArrayRecord({f"{PACKED}:{layout_digest(arrays)}": Array(pack(arrays))})
    # np.require keeps 0-d arrays (scalars such as a gate) 0-d; np.ascontiguousarray would make them (1,).
    return ArrayRecord({k: Array(np.require(arrays[k], dtype=np.float32, requirements="C")) for k in sorted(arrays)})


def from_array_record(record: ArrayRecord, reference: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Named arrays from a record. With ``reference`` (the names and shapes expected): packed records are unpacked
    (their layout digest must match), and positional ones (SecAgg+ re-packed) are mapped onto sorted names."""
    from flwr.common import bytes_to_ndarray

    # Arrays re-packed from legacy Parameters carry no shape/dtype, only np.save bytes: decode those bytes.
    values = {k: bytes_to_ndarray(v.data) if not v.shape else v.numpy() for k, v in record.items()}
    packed = [k for k in values if k.startswith(PACKED + ":")]
    if packed or (reference is not None and len(values) == 1 and set(values) != set(reference)):
        if reference is None:
            raise ReplyError("a packed adapter needs the expected names and shapes to unpack")
        if len(values) != 1:
            raise ReplyError(f"a packed adapter is one array, got {len(values)}")
        key, vector = next(iter(values.items()))
        if packed and key != f"{PACKED}:{layout_digest(reference)}":
            raise ReplyError(
                f"adapter layout (names or shapes) differs from the expected one: {vector.size} numbers, "
                f"expected {sum(_sizes(reference))} in {len(reference)} arrays"
            )
        return unpack(vector, reference)
    if reference is None or set(values) == set(reference):
        return values
    names = sorted(reference)
    if len(values) != len(names):
        raise ReplyError(f"expected {len(names)} arrays, got {len(values)}")
    return dict(zip(names, values.values()))


def train_instruction(arrays: dict[str, np.ndarray], config: dict[str, Any]) -> RecordDict:
    return RecordDict({FITINS_ARRAYS: to_array_record(arrays, packed=True), FITINS_CONFIG: ConfigRecord(config)})


def read_sent_adapter(record: ArrayRecord, reference: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The adapter the server sent (as ``reference``'s names and shapes), or None when it sent none (a strategy
    whose clients keep their own, e.g. local-only training)."""
    return from_array_record(record, reference) if len(record) else None


def read_train_config(content: RecordDict) -> dict[str, Any]:
    """The config of a train instruction (read first: it may say what shapes the arrays have)."""
    return dict(content.config_records[FITINS_CONFIG])


def read_train_arrays(content: RecordDict, reference: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The start adapter of a train instruction (``read_sent_adapter``)."""
    return read_sent_adapter(content.array_records[FITINS_ARRAYS], reference)


def read_train_instruction(
    content: RecordDict, reference: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray] | None, dict[str, Any]]:
    """The start adapter (``read_sent_adapter``) and the config of a train instruction."""
    return read_train_arrays(content, reference), read_train_config(content)


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Lists joined by commas: SecAgg+ converts replies to legacy FitRes, whose metrics take scalars only."""
    return {k: joined(v) if isinstance(v, (list, tuple)) else v for k, v in metrics.items()}


def train_reply(arrays: dict[str, np.ndarray], num_examples: int, metrics: dict[str, Any]) -> RecordDict:
    return RecordDict(
        {
            FITRES_ARRAYS: to_array_record(arrays, packed=True),
            FITRES_NUM_EXAMPLES: MetricRecord({"num_examples": int(num_examples)}),
            FITRES_METRICS: ConfigRecord(scalar_metrics(metrics)),
            FITRES_STATUS: ConfigRecord({"code": 0, "message": "ok"}),
        }
    )


def check_arrays(arrays: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    """Raise ReplyError unless ``arrays`` has exactly the reference's keys and shapes and only finite values."""
    missing, extra = sorted(set(reference) - set(arrays)), sorted(set(arrays) - set(reference))
    if missing or extra:
        raise ReplyError(
            f"keys differ from the adapter: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}"
        )
    for key, ref in reference.items():
        if arrays[key].shape != ref.shape:
            raise ReplyError(f"{key}: shape {arrays[key].shape} != {ref.shape}")
        if not np.all(np.isfinite(arrays[key])):
            raise ReplyError(f"{key}: contains NaN or Inf")


def read_train_reply(
    content: RecordDict, reference: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], Any, dict[str, Any]]:
    """Decode a plain-mode train reply: its arrays (checked against the names and shapes sent), num_examples and
    metrics as sent."""
    for key in (FITRES_ARRAYS, FITRES_NUM_EXAMPLES, FITRES_METRICS):
        if key not in content:
            raise ReplyError(f"reply lacks '{key}'")
    arrays = from_array_record(content.array_records[FITRES_ARRAYS], reference)
    check_arrays(arrays, reference)
    # as sent: the server checks and caps it (common.reply_checks.check_weight)
    count = content.metric_records[FITRES_NUM_EXAMPLES]["num_examples"]
    return arrays, count, dict(content.config_records[FITRES_METRICS])


def eval_instruction(arrays: dict[str, np.ndarray], config: dict[str, Any]) -> RecordDict:
    return RecordDict({ARRAYS: to_array_record(arrays, packed=True), CONFIG: ConfigRecord(config)})


def metrics_reply(metrics: dict[str, Any]) -> RecordDict:
    return RecordDict({METRICS: ConfigRecord(metrics)})


def read_metrics(content: RecordDict) -> dict[str, Any]:
    if METRICS not in content:
        raise ReplyError(f"reply lacks '{METRICS}'")
    return dict(content.config_records[METRICS])


def query_instruction(server_round: int, query: QueryPart) -> RecordDict:
    """A QUERY message: ``initial-adapter`` (the client's fresh adapter and identity) or ``report`` (the strategy's)."""
    return RecordDict(
        {CONFIG: ConfigRecord(encode({"the round": RoundPart(server_round=server_round), "the query": query}))}
    )


def adapter_digest(arrays: dict[str, np.ndarray]) -> str:
    """A fingerprint of an adapter's names, shapes, dtypes and values (equal adapters, equal digests)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{value.shape}|{value.dtype}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def initial_reply(arrays: dict[str, np.ndarray], identity: dict[str, Any], send_adapter: bool = True) -> RecordDict:
    """The client's identity with its initial adapter's digest, and the adapter itself when asked for it."""
    identity = {**identity, ADAPTER_DIGEST: adapter_digest(arrays)}
    return RecordDict({ARRAYS: to_array_record(arrays if send_adapter else {}), METRICS: ConfigRecord(identity)})


def _arrays_and_metrics(content: RecordDict, key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Named arrays under ``key`` and the reply's metrics (empty when it has none)."""
    if key not in content:
        raise ReplyError(f"reply lacks '{key}'")
    metrics = dict(content.config_records[METRICS]) if METRICS in content else {}
    return from_array_record(content.array_records[key]), metrics


def read_initial_reply(content: RecordDict) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The client's initial adapter (finite values only) and identity (partition id, model, ...)."""
    arrays, identity = _arrays_and_metrics(content, ARRAYS)
    for key, value in arrays.items():
        if not np.all(np.isfinite(value)):
            raise ReplyError(f"{key}: contains NaN or Inf")
    return arrays, identity


def report_reply(arrays: dict[str, np.ndarray], metrics: dict[str, Any]) -> RecordDict:
    """A strategy's per-round report: named arrays (e.g. a signature) and metrics (numbers, lists of numbers)."""
    return RecordDict({REPORT: to_array_record(arrays), METRICS: ConfigRecord(metrics)})


def read_report_reply(content: RecordDict) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A report's arrays and metrics; the strategy validates what they mean (``Strategy.read_report``)."""
    return _arrays_and_metrics(content, REPORT)


def save_arrays(arrays: dict[str, np.ndarray], out_dir: str | Path) -> Path:
    """Named float32 arrays as ``arrays.safetensors`` in ``out_dir`` (for state that is not a PEFT adapter)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}, str(out / "arrays.safetensors")
    )
    return out
