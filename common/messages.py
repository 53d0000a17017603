"""The messages between server and client as a typed contract: one schema per concern, one codec.

Every key an instruction's config carries is the alias of one field of one schema: the core ones here (the round,
how a member weighs its update, SecAgg+'s bounds, differential privacy's clip and noise, the query kind, and the
identity a client sends beside its metrics) or a strategy's own (``StrategySpec.wire``, e.g. ATLAS's per-layer
ranks), whose keys the registry checks against the core's. ``encode`` writes parts as one config (a key set twice
is a mistake naming both sources); ``read_train`` / ``read_evaluate`` / ``read_query`` read an instruction back into
typed parts, refusing a missing, mistyped, out-of-range or unknown key by name (``MessageError``: the handler
raises it, so the server leaves the node out with the reason, as it does a bad reply).

Lists travel comma-joined (``joined`` / ``split``): SecAgg+ turns train messages into legacy FitIns / FitRes,
whose configs and metrics take scalars only. This is the only list codec of the wire (replies' metrics too:
``common.records.scalar_metrics``, ``common.reply_checks``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    StrictStr,
    ValidationError,
)

WEIGHT_BY_EXAMPLES = "examples"  # the examples a member trained on this round (FedAvg)
WEIGHT_EQUALLY = "equal"  # 1 each: a plain mean (or, with max_weight 1, a plain sum's share)
QUERY_INITIAL, QUERY_REPORT = "initial-adapter", "report"


class ReplyError(ValueError):
    """A client reply that cannot be used (missing key, wrong shape, NaN/Inf, ...)."""


class MessageError(ReplyError):
    """An instruction (or a part of a reply) that does not follow its schema: the key and why."""


def joined(values: Iterable[Any], fmt: str = "") -> str:
    """A list as one scalar value, comma-joined (``fmt``: each number's format, e.g. ``".6g"``)."""
    return ",".join(format(x, fmt) if fmt else str(x) for x in values)


def split(value: Any, kind: type = float) -> list:
    """The inverse of ``joined`` ("0.5,0.4" -> [0.5, 0.4]; "" -> []); a list (or tuple) passes through, each
    element as ``kind``; None -> []."""
    if isinstance(value, str):
        return [kind(x) for x in value.split(",") if x.strip()]
    return [kind(x) for x in value] if value is not None else []


def _number(value: Any) -> Any:
    """A config number as sent: text, truth values and lists are refused (pydantic would read "1" or True)."""
    if isinstance(value, (bool, str, bytes, list, tuple)):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    return value


def _whole(value: Any) -> Any:
    value = _number(value)
    if isinstance(value, float):
        raise ValueError("expected a whole number, got a float")
    return value


def _joined_list(kind: type) -> Any:
    """A list's validator: comma-joined text as it travels, or a list (or tuple) as a part is built; every element a
    finite number of ``kind``."""

    def element(value: Any) -> Any:
        if isinstance(value, str):
            value = float(value) if kind is float else int(value)  # "1.5" as an int: ValueError
        value = _whole(value) if kind is int else _number(value)
        if not math.isfinite(value):
            raise ValueError(f"expected finite numbers, got {value!r}")
        return kind(value)

    def read(value: Any) -> tuple:
        if isinstance(value, str):
            value = [x for x in value.split(",") if x.strip()]
        elif not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a comma-joined list, got {type(value).__name__}")
        return tuple(element(x) for x in value)

    return read


Int = Annotated[int, BeforeValidator(_whole)]
Float = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]
Ints = Annotated[tuple[int, ...], BeforeValidator(_joined_list(int)), PlainSerializer(joined)]
# six significant digits: what a prior needs, and what the demo's instructions have always carried
Floats = Annotated[tuple[float, ...], BeforeValidator(_joined_list(float)), PlainSerializer(lambda v: joined(v, ".6g"))]


class Part(BaseModel):
    """One concern of a message: its fields, each travelling under its alias (the wire key).

    Attributes:
        about: how a refusal names the part (``"SecAgg+"``, ``"atlas"``).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")
    about: ClassVar[str] = "message"

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The wire keys of this part."""
        return tuple(field.alias or name for name, field in cls.model_fields.items())

    def wire(self) -> dict[str, Any]:
        """This part as config values (lists joined; unset optional fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class RoundPart(Part):
    """Every instruction and query: the round it belongs to (0: before training)."""

    about: ClassVar[str] = "round"
    server_round: Int = Field(alias="server-round", ge=0)


class WeightingPart(Part):
    """A train instruction: the member's weight in its group's sum, which it reports as its reply's ``num_examples``
    (what SecAgg+ multiplies by before masking), so that plain and secure sums agree."""

    about: ClassVar[str] = "weighting"
    # "examples", "equal", or a weighting of the strategy's own (``StrategyClient.member_weight`` says which it knows)
    weight_by: StrictStr = Field(WEIGHT_BY_EXAMPLES, alias="weight-by", min_length=1, max_length=64)


class SecAggPart(Part):
    """A secure train instruction: SecAgg+'s clipping range and the group's max weight (so that a member caps its
    weight and counts the values SecAgg+ will clamp), and the L2 norm it clips its own update to before masking
    (the server cannot clip what it cannot see)."""

    about: ClassVar[str] = "SecAgg+"
    clipping_range: Float = Field(alias="secagg-clipping-range", gt=0)
    max_weight: Float = Field(alias="secagg-max-weight", gt=0)
    clip_norm: Float = Field(alias="secagg-clip-norm", gt=0)


class DpPart(Part):
    """A differentially private train instruction (``dp.*``, ``common.privacy``): the norm the member clips its update
    to, the round's noise multiplier and delta (what its own ledger counts), and in distributed mode the std of the
    noise it adds before masking."""

    about: ClassVar[str] = "dp"
    clip_norm: Float = Field(alias="dp-clip-norm", gt=0)
    noise_multiplier: Float = Field(alias="dp-noise-multiplier", ge=0)
    delta: Float = Field(alias="dp-delta", gt=0, lt=1)
    noise_std: Float | None = Field(None, alias="dp-noise-std", ge=0)


class QueryPart(Part):
    """A query: the client's initial adapter and identity (``send-adapter`` False: its digest only, what admission
    compares), or this round's report of the strategy's client half."""

    about: ClassVar[str] = "query"
    query: Literal["initial-adapter", "report"] = Field(alias="query")
    send_adapter: StrictBool = Field(True, alias="send-adapter")


class Identity(Part):
    """Who answered, sent beside every reply's metrics (its data counts after these); the server's evaluation rows
    carry each field (dashes as underscores). The server checks what it relies on itself
    (``server_app.admission.read_identity``): a client's word is not a schema's."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid", protected_namespaces=())
    about: ClassVar[str] = "identity"
    partition_id: int = Field(alias="partition-id")
    tasks: str = Field(alias="tasks")
    model: str = Field(alias="model")
    pid: int = Field(alias="pid")
    model_loads: int = Field(alias="model-loads")
    model_load_seconds: float = Field(alias="model-load-seconds")
    peak_rss_mb: float = Field(alias="peak-rss-mb")
    startup_seconds: float = Field(alias="startup-seconds")
    ray_node: str = Field(alias="ray-node")
    state_restored: str = Field(alias="state-restored")
    state_bytes: int = Field(alias="state-bytes")


# an initial reply's identity key beside the Identity: the digest of the client's initial adapter
ADAPTER_DIGEST = "adapter-digest"
CORE_PARTS: tuple[type[Part], ...] = (RoundPart, WeightingPart, SecAggPart, DpPart, QueryPart)
P = TypeVar("P", bound=Part)


def encode(sources: Mapping[str, Part | Mapping[str, Any] | None]) -> dict[str, Any]:
    """The config of a message from its parts (source name -> part; None: nothing). A key two sources set is a
    mistake (one would silently win): ValueError naming it and both sources."""
    merged: dict[str, Any] = {}
    said: dict[str, str] = {}
    for source, part in sources.items():
        values = part.wire() if isinstance(part, Part) else dict(part or {})
        for key, value in values.items():
            if key in merged:
                raise ValueError(f"instruction: key {key!r} set by {said[key]} and by {source}")
            merged[key], said[key] = value, source
    return merged


def decode(part: type[P], config: Mapping[str, Any], optional: bool = False) -> P | None:
    """``part`` read from a message's config (its keys only); with ``optional``, None when the config holds none of
    them. MessageError names the first key that is missing, mistyped or out of range."""
    present = {k: v for k, v in config.items() if k in part.keys()}
    if optional and not present:
        return None
    try:
        return part.model_validate(present)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(x) for x in first["loc"]) or part.__name__
        got = "" if first["type"] == "missing" else f" (got {str(first.get('input'))[:40]!r})"
        raise MessageError(f"{part.about} key '{key}': {first['msg']}{got}") from None


def _refuse_unknown(config: Mapping[str, Any], parts: Iterable[type[Part] | None], kind: str) -> None:
    known = {key for part in parts if part is not None for key in part.keys()}
    unknown = sorted(str(k) for k in config if k not in known)
    if unknown:
        raise MessageError(f"{kind} instruction: unexpected key {unknown[0]!r} (no schema of this run has it)")


@dataclass(frozen=True)
class TrainInstruction:
    """A train instruction's config, read: the round, the weighting, SecAgg+'s and DP's parts when the run has
    them, and the strategy's own part (None: its schema is empty, or it sent none of its keys)."""

    round: RoundPart
    weighting: WeightingPart
    secagg: SecAggPart | None
    dp: DpPart | None
    strategy: Part | None


@dataclass(frozen=True)
class EvaluateInstruction:
    """An evaluate instruction's config, read: the round and the strategy's own part."""

    round: RoundPart
    strategy: Part | None


def read_train(config: Mapping[str, Any], wire: type[Part] | None) -> TrainInstruction:
    """A train instruction's config as typed parts (``wire``: the strategy's schema)."""
    _refuse_unknown(config, (RoundPart, WeightingPart, SecAggPart, DpPart, wire), "train")
    return TrainInstruction(
        round=decode(RoundPart, config),  # type: ignore[arg-type]  # required: never None
        weighting=decode(WeightingPart, config),  # type: ignore[arg-type]
        secagg=decode(SecAggPart, config, optional=True),
        dp=decode(DpPart, config, optional=True),
        strategy=decode(wire, config, optional=True) if wire is not None else None,
    )


def read_evaluate(config: Mapping[str, Any], wire: type[Part] | None) -> EvaluateInstruction:
    """An evaluate instruction's config as typed parts."""
    _refuse_unknown(config, (RoundPart, wire), "evaluate")
    strategy = decode(wire, config, optional=True) if wire is not None else None
    return EvaluateInstruction(decode(RoundPart, config), strategy)  # type: ignore[arg-type]


def read_query(config: Mapping[str, Any]) -> tuple[RoundPart, QueryPart]:
    """A query's config as its round and its kind."""
    _refuse_unknown(config, (RoundPart, QueryPart), "query")
    return decode(RoundPart, config), decode(QueryPart, config)  # type: ignore[return-value]


def clashes(wire: type[Part]) -> list[str]:
    """The keys of a strategy's schema that a core part already has (registration refuses them)."""
    core = {key for part in CORE_PARTS for key in part.keys()}
    return sorted(set(wire.keys()) & core)
