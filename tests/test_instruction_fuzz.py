"""Every key an instruction carries, for every strategy (the core parts and the strategy's own,
``StrategySpec.wire``): wrong types, NaN, infinities, huge and negative numbers, lists where a number belongs,
text where a list belongs. Each bad value is refused by the client naming its key (``MessageError``, which the
handler raises, so the server leaves the node out with the reason, as it does a bad reply), or read as a typed
value within its schema; a missing round and a key no schema has are refused by name; what the server encodes
reads back as the parts it sent."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from pydantic import Field

from common.messages import (
    QUERY_INITIAL,
    DpPart,
    MessageError,
    Part,
    QueryPart,
    RoundPart,
    SecAggPart,
    WeightingPart,
    encode,
    read_evaluate,
    read_query,
    read_train,
)
from strategies import REGISTRY, register

BAD = ["x", "", "1,nan", "1e999", float("nan"), float("inf"), -float("inf"), -1, -1e300, 1e300, 10**30, True, [1.5]]
HONEST = {
    "the round": RoundPart(server_round=2),
    "the weighting": WeightingPart(),
    "SecAgg+": SecAggPart(clipping_range=8.0, max_weight=16.0, clip_norm=1.0),
    "differential privacy": DpPart(clip_norm=1.0, noise_multiplier=0.8, delta=1e-5, noise_std=0.1),
}


def train_keys():
    for name, spec in REGISTRY.items():
        parts = [RoundPart, WeightingPart, SecAggPart, DpPart, *([spec.wire] if spec.wire else [])]
        for part in parts:
            for key in part.keys():
                yield pytest.param(name, part, key, id=f"{name}-{key}")


def typed(value) -> bool:
    """A value a part may hold once read: finite numbers, truth values where declared, text, lists of numbers."""
    if isinstance(value, tuple):
        return all(typed(v) and not isinstance(v, bool) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (int, str, bool))


def field_of(part: type[Part], key: str) -> str:
    return next(name for name, field in part.model_fields.items() if (field.alias or name) == key)


@pytest.mark.parametrize(("name", "part", "key"), list(train_keys()))
def test_every_bad_value_of_every_train_instruction_key_is_refused_naming_it_or_read_typed(name, part, key):
    wire = REGISTRY[name].wire
    for value in BAD:
        config = {**encode(HONEST), key: value}
        try:
            instruction = read_train(config, wire)
        except MessageError as err:
            assert f"'{key}'" in str(err), (key, value, str(err))
            continue
        held = {RoundPart: instruction.round, WeightingPart: instruction.weighting, SecAggPart: instruction.secagg}
        held |= {DpPart: instruction.dp, **({wire: instruction.strategy} if wire else {})}
        read = getattr(held[part], field_of(part, key))
        assert typed(read), (key, value, read)


def test_an_instruction_without_its_round_or_with_a_key_no_schema_has_is_refused_naming_it():
    config = encode(HONEST)
    with pytest.raises(MessageError, match="round key 'server-round': Field required"):
        read_train({k: v for k, v in config.items() if k != "server-round"}, None)
    with pytest.raises(MessageError, match="unexpected key 'num-server-rounds'"):
        read_train({**config, "num-server-rounds": 3}, None)  # what the client already has: never sent
    with pytest.raises(MessageError, match="unexpected key 'active-blocks'"):
        read_train({**config, "active-blocks": "1"}, None)  # another strategy's key in a FedAvg run
    with pytest.raises(MessageError, match="SecAgg\\+ key 'secagg-max-weight': Field required"):
        read_train({k: v for k, v in config.items() if k != "secagg-max-weight"}, None)  # a part comes whole
    with pytest.raises(MessageError, match="unexpected key 'weight-by'"):
        read_evaluate(encode({"r": HONEST["the round"], "w": HONEST["the weighting"]}), None)  # nor weighted


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_what_the_server_encodes_reads_back_as_the_parts_it_sent(name):
    wire = REGISTRY[name].wire
    instruction = read_train(encode(HONEST), wire)
    assert (instruction.round, instruction.weighting) == (HONEST["the round"], HONEST["the weighting"])
    assert (instruction.secagg, instruction.dp) == (HONEST["SecAgg+"], HONEST["differential privacy"])
    assert read_train(encode({"the round": RoundPart(server_round=0)}), wire).secagg is None  # plain: no part
    assert read_evaluate(encode({"the round": RoundPart(server_round=3)}), wire).round.server_round == 3


@pytest.mark.parametrize("key", ["server-round", "query", "send-adapter"])
def test_every_bad_value_of_every_query_key_is_refused_naming_it_or_read_typed(key):
    for value in BAD:
        config = {**encode({"r": RoundPart(server_round=0), "q": QueryPart(query=QUERY_INITIAL)}), key: value}
        try:
            at, query = read_query(config)
        except MessageError as err:
            assert f"'{key}'" in str(err), (key, value, str(err))
            continue
        assert at.server_round >= 0 and isinstance(query.send_adapter, bool) and query.query == QUERY_INITIAL


def test_the_strategies_parts_travel_lists_as_text_and_read_them_back():
    from strategies.atlas.wire import AtlasWire
    from strategies.vemoe.wire import VemoeWire

    ranks = AtlasWire(own_ranks=(2, 6), wire_ranks=(8, 8), neighbour_term=True)
    assert ranks.wire() == {"lora-ranks": "2,6", "wire-ranks": "8,8", "neighbour-term": True}
    prior = VemoeWire(birth_slot=1, prior=(1 / 3, 2 / 3))
    assert prior.wire()["vemoe-prior"] == "0.333333,0.666667"  # six significant digits, as it always travelled
    assert read_train(encode({**HONEST, "vemoe": prior}), VemoeWire).strategy == VemoeWire(
        birth_slot=1, prior=(0.333333, 0.666667)
    )


def test_a_strategy_whose_wire_key_is_a_core_parts_is_refused_at_registration():
    from toy_strategy import SPEC, ToyMean

    class Clashing(Part):
        round_again: int = Field(0, alias="server-round")

    class ClashingMean(ToyMean):
        name = "clashing-mean"

    with pytest.raises(ValueError, match=r"wire keys \['server-round'\] are a core message part's"):
        register(replace(SPEC, name="clashing-mean", server=ClashingMean, section=None, wire=Clashing))
    assert "clashing-mean" not in REGISTRY


def test_a_strategy_whose_server_half_leaves_a_required_method_undone_is_refused_at_registration():
    from toy_strategy import SPEC

    from strategies.base import Strategy

    class Unfinished(Strategy):  # every required method left abstract
        name = "unfinished-mean"

    with pytest.raises(ValueError, match=r"server half does not implement \['eval_arrays', 'final_adapters'"):
        register(replace(SPEC, name="unfinished-mean", server=Unfinished, section=None))
    with pytest.raises(ValueError, match="client half is not a strategies.client.StrategyClient"):
        register(replace(SPEC, name="no-client-mean", client=object))  # type: ignore[arg-type]
    assert "unfinished-mean" not in REGISTRY
