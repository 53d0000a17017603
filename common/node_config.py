"""A SuperNode's node config (``--node-config "partition-id=0 ..."``) as one typed section, validated once.

Every key a node may set is a field here, under its own name (the alias). ``node_settings`` reads a node config
into ``NodeSettings`` (cached: a node's config is read once, however many messages it serves) or raises
``NodeConfigError`` naming the key on the node, never its value (a node's paths and budgets are the member's). Keys
beyond these are left to whoever declares them (ATLAS's ``memory-mb``); an unknown ``data-`` key is refused, as a
misspelt data key would silently train on the wrong data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .section import true_or_false

WORKER_MODES = ("auto", "on", "off")  # how a deployed node runs its model: a long-lived worker, or per message
DATA_KEYS = ("data-path", "data-format", "data-test-path")


class NodeConfigError(ValueError):
    """A node config value that cannot be used: ``node-config <key>: <what it must be>``."""


def _yes_no(value: Any) -> bool:
    if (read := true_or_false(value)) is None:
        raise ValueError("expected true or false")
    return read


def _whole(low: int) -> Any:
    def read(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"expected an integer >= {low}")
        return value

    return read


def _number(what: str, holds: Any) -> Any:
    """A number as a node config may write it (TOML number, or text such as "12.5e-3"); ``what`` it must be."""

    def read(value: Any) -> float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                value = None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"must be {what}")
        if not holds(value):
            raise ValueError(f"must be {what}")
        return float(value)

    return read


def _text(value: Any) -> str:
    if not (isinstance(value, str) and value.strip()):
        raise ValueError("expected a non-empty string")
    return value


def _worker(value: Any) -> str:
    mode = str(value).lower()
    if mode not in WORKER_MODES:
        raise ValueError(f"expected one of {', '.join(WORKER_MODES)} (got '{mode}')")
    return mode


YesNo = Annotated[bool, BeforeValidator(_yes_no)]
Text = Annotated[str, BeforeValidator(_text)]
Positive = Annotated[float, BeforeValidator(_number("a number > 0", lambda v: v > 0))]


class NodeSettings(BaseModel):
    """What a member's SuperNode says of itself (every field optional; docs/deployment.md has the keys).

    Attributes:
        partition_id, num_partitions: which of the federation's partitions this node is (its stable identity).
        model: the base model it loads (default: the run's ``model-for-partition``).
        data_path, data_format, data_test_path: its own data (``common.data``): the file, its format, a held-out
            file of its own.
        allow_run_config_paths: whether a run config may name files on this node (simulation always may).
        keep_evaluation: its evaluation stays on the node (the server learns that it evaluated).
        max_micro_batch: the most examples a forward pass takes at once (a smaller GPU: more passes, same update).
        audit_dir: where it keeps a clear copy of what it contributes each round.
        worker, worker_idle_timeout: whether its model lives in a long-lived worker, and for how long it idles.
        state_dir: where its client state and privacy ledger live ("" the default; in simulation: in memory).
        dp_record_epsilon, dp_record_delta, dp_record_clip, dp_record_noise_multiplier: its own record-level
            DP-SGD budget (``client_app.record_dp``).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="allow", protected_namespaces=())

    partition_id: Annotated[int, BeforeValidator(_whole(0))] = Field(0, alias="partition-id")
    num_partitions: Annotated[int, BeforeValidator(_whole(1))] = Field(1, alias="num-partitions")
    model: Text | None = Field(None, alias="model")
    data_path: Text | None = Field(None, alias="data-path")
    data_format: Text | None = Field(None, alias="data-format")
    data_test_path: Text | None = Field(None, alias="data-test-path")
    allow_run_config_paths: YesNo = Field(False, alias="allow-run-config-paths")
    keep_evaluation: YesNo = Field(False, alias="keep-evaluation")
    max_micro_batch: Annotated[int, BeforeValidator(_whole(1))] | None = Field(None, alias="max-micro-batch")
    audit_dir: Text | None = Field(None, alias="audit-dir")
    worker: Annotated[Literal["auto", "on", "off"], BeforeValidator(_worker)] = Field("auto", alias="worker")
    worker_idle_timeout: Positive = Field(1800.0, alias="worker-idle-timeout")
    state_dir: str = Field("", alias="state-dir")
    dp_record_epsilon: Positive | None = Field(None, alias="dp-record-epsilon")
    dp_record_delta: Annotated[float, BeforeValidator(_number("a number in (0, 1)", lambda v: 0 < v < 1))] | None = (
        Field(None, alias="dp-record-delta")
    )
    dp_record_clip: Positive | None = Field(None, alias="dp-record-clip")
    dp_record_noise_multiplier: (
        Annotated[float, BeforeValidator(_number("a number in [0, 1000]", lambda v: 0 <= v <= 1e3))] | None
    ) = Field(None, alias="dp-record-noise-multiplier")


def node_settings(node_config: Mapping[str, Any]) -> NodeSettings:
    """The node config, read and checked (``NodeConfigError`` naming the first bad key)."""
    try:
        # the type in the key: 1 == True (and hashes alike), but only True is a yes
        return _read(tuple(sorted((str(k), type(v).__name__, _hashable(v)) for k, v in node_config.items())))
    except TypeError:  # a value that cannot be a cache key (a list): read it uncached
        return _validate(dict(node_config))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@lru_cache(maxsize=256)
def _read(items: tuple[tuple[str, str, Any], ...]) -> NodeSettings:
    return _validate({key: value for key, _, value in items})


def _validate(values: dict[str, Any]) -> NodeSettings:
    unknown = sorted(k for k in values if k.startswith("data-") and k not in DATA_KEYS)
    if unknown:
        raise NodeConfigError(f"node config: unknown key(s) {unknown}; the data keys are {list(DATA_KEYS)}")
    try:
        return NodeSettings.model_validate(values)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(x) for x in first["loc"])
        reason = str(first["msg"]).removeprefix("Value error, ")  # never the value: it may be the member's
        raise NodeConfigError(f"node-config {key}: {reason}") from None
