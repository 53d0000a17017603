"""Do no harm (``common.guard``): a client keeps, of what the server sends, the share that does not raise its own
validation loss. The math on plain tensors; the ClientApp's guard on a tiny random Llama with LoRA; the config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from client_app.do_no_harm import guard_own as guard
from client_app.runtime import ClientRuntime, LoadedModel
from common.adapters import ClientState, adapter_kind
from common.config import ConfigError
from common.data import ClientData, Example
from common.guard import (
    GUARD_STATE_KEY,
    best_share,
    choose,
    guard_state_key,
    mixed,
    snapshot,
    strategy_kept,
    trained_names,
)
from common.model import load_base_model, load_tokenizer
from common.training import train_round
from strategies import load_run_config, strategy_spec
from strategies.client import StrategyClient

TRAIN = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8)]
VALIDATION = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8, 16)]
GUARDED = {
    "strategy": "fedavg",
    "guard.enabled": True,
    "guard.reference": "own",
    "data.validation-fraction": 0.2,
    "lora.r": 4,
}


def test_mixed_is_the_share_weighted_blend_and_refuses_shares_outside_0_1():
    server, own = {"w": np.array([2.0, 4.0])}, {"w": np.array([0.0, 0.0])}
    np.testing.assert_allclose(mixed(server, own, 0.25)["w"], [0.5, 1.0])
    np.testing.assert_array_equal(mixed(server, own, 1.0)["w"], server["w"])
    np.testing.assert_array_equal(mixed(server, own, 0.0)["w"], own["w"])
    with pytest.raises(ValueError, match="share 1.5"):
        mixed(server, own, 1.5)


def test_the_lowest_loss_wins_a_tie_goes_to_the_server_and_nan_never_wins():
    assert best_share({0.0: 1.0, 0.5: 0.8, 1.0: 0.9}) == 0.5
    assert best_share({0.0: 0.7, 1.0: 0.7}) == 1.0  # refuse only what measurably hurts
    assert best_share({0.0: 0.9, 1.0: float("nan")}) == 0.0


def linear(weight: list[float]) -> torch.nn.Linear:
    model = torch.nn.Linear(len(weight), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weight]))
    return model


def distance_to(model: torch.nn.Linear, target: list[float]):
    calls = []

    def loss() -> float:
        calls.append(1)
        return float(((model.weight.detach()[0] - torch.tensor(target)) ** 2).sum())

    return loss, calls


@pytest.mark.parametrize(
    "target, shares, kept",
    [
        ([0.0, 0.0], [0.0, 1.0], 0.0),  # the server's adapter is worse: the client keeps its own
        ([4.0, 4.0], [0.0, 1.0], 1.0),  # better: it adopts it
        ([2.0, 2.0], [0.0, 0.5, 1.0], 0.5),  # halfway is best: it mixes half in
    ],
)
def test_choose_leaves_the_model_at_the_share_of_lowest_validation_loss(target, shares, kept):
    model = linear([4.0, 4.0])  # what the server's message set
    own = {"weight": np.zeros((1, 2), dtype=np.float32)}
    loss, calls = distance_to(model, target)
    metrics = choose(model, own, shares, loss)
    assert metrics["guard_share"] == kept
    np.testing.assert_allclose(model.weight.detach().numpy(), [[4.0 * kept, 4.0 * kept]])
    assert len(calls) == len(shares)
    assert metrics["guard_server_loss"] == pytest.approx(sum((4.0 - t) ** 2 for t in target))
    assert metrics["guard_own_loss"] == pytest.approx(sum(t**2 for t in target))


def test_choose_measures_nothing_when_the_server_sent_the_clients_own_adapter():
    model = linear([1.0, 2.0])
    loss, calls = distance_to(model, [0.0, 0.0])
    assert choose(model, snapshot(model, ["weight"]), [0.0, 1.0], loss) == {"guard_share": 1.0}
    assert not calls  # local-only: nothing to choose between, no evaluation spent


def test_choose_skips_parameters_whose_shape_changed():
    model = linear([4.0, 4.0])
    loss, calls = distance_to(model, [0.0, 0.0])
    assert choose(model, {"weight": np.zeros((1, 3), dtype=np.float32)}, [0.0, 1.0], loss) == {"guard_share": 1.0}
    assert not calls


def runtime(tiny_llama_dir, settings: dict) -> ClientRuntime:
    cfg = load_run_config(settings)
    loaded = LoadedModel(str(tiny_llama_dir), load_base_model(str(tiny_llama_dir), "fp32", "cpu"), None, 1)
    loaded.tokenizer = load_tokenizer(str(tiny_llama_dir))
    adapter = loaded.attach(adapter_kind(cfg.adapter), cfg)
    ctx = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    state = ClientState(ctx.state, strategy_spec(cfg.strategy).state_keys(cfg))
    data = ClientData(TRAIN, TRAIN, validation=VALIDATION)
    return ClientRuntime(cfg, loaded, adapter, StrategyClient(cfg), state, 0, 1, {}, data)


def trained_own(rt: ClientRuntime) -> dict[str, np.ndarray]:
    """The client trains from the run's initial adapter and keeps its own copy, as the train handler does."""
    rt.adapter.begin(rt.state, rt.adapter.initial)
    rt.adapter.prepare_training()
    train_round(rt.model, rt.tokenizer, TRAIN, rt.cfg.train_settings(), 0.05, seed=0)
    own = snapshot(rt.model, trained_names(rt.model))
    rt.state.put(GUARD_STATE_KEY, own)
    return own


def test_a_client_refuses_a_server_adapter_that_raises_its_validation_loss(tiny_llama_dir):
    rt = runtime(tiny_llama_dir, GUARDED)
    assert guard(rt) == {"guard_share": 1.0}  # nothing trained yet: the server's, unmeasured
    own = trained_own(rt)
    rng = np.random.default_rng(0)
    harmful = {k: v + rng.normal(scale=2.0, size=v.shape).astype(np.float32) for k, v in rt.adapter.initial.items()}
    rt.adapter.begin(rt.state, harmful)  # the federation's adapter: far from anything this client learnt
    metrics = guard(rt)
    assert metrics["guard_share"] == 0.0
    assert metrics["guard_own_loss"] < metrics["guard_server_loss"]
    now = snapshot(rt.model, list(own))
    assert all(np.array_equal(now[k], own[k]) for k in own)  # it evaluates and trains on its own adapter


def test_a_client_adopts_a_server_adapter_that_lowers_its_validation_loss(tiny_llama_dir):
    rt = runtime(tiny_llama_dir, GUARDED)
    own = trained_own(rt)
    # the federation's adapter: this client's, trained further on examples like its validation ones
    train_round(rt.model, rt.tokenizer, VALIDATION, rt.cfg.train_settings(), 0.05, seed=1)
    better = snapshot(rt.model, list(own))
    metrics = guard(rt)
    assert metrics["guard_share"] == 1.0
    assert metrics["guard_server_loss"] < metrics["guard_own_loss"]
    now = snapshot(rt.model, list(own))
    assert all(np.array_equal(now[k], better[k]) for k in own)


def test_without_the_guard_a_client_neither_measures_nor_keeps_a_copy(tiny_llama_dir):
    rt = runtime(tiny_llama_dir, {"strategy": "fedavg", "lora.r": 4})
    assert guard(rt) == {}
    assert GUARD_STATE_KEY not in strategy_spec("fedavg").state_keys(rt.cfg)


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"guard.enabled": True}, "guard.enabled: it chooses on the validation split"),
        (
            {"guard.enabled": True, "data.validation-fraction": 0.2, "data.eval-split": "validation"},
            "guard.enabled: not with data.eval-split",
        ),
        ({"guard.shares": "0,1.5"}, "guard.shares"),
        ({"guard.shares": "1"}, "guard.shares"),
        ({"guard.examples": 0}, "guard.examples"),
        ({"guard.standard-errors": -1}, "guard.standard-errors"),
        ({"guard.enabled": "sometimes"}, "guard.enabled"),
    ],
)
def test_a_bad_guard_config_names_its_key(settings, says):
    with pytest.raises(ConfigError, match=says):
        load_run_config({"strategy": "fedavg", **settings})


def test_every_strategy_can_guard_and_keeps_the_copy_under_a_declared_key():
    from strategies import REGISTRY

    for name, spec in REGISTRY.items():
        cfg = load_run_config({**GUARDED, "strategy": name, "lora.r": 8})
        assert GUARD_STATE_KEY in spec.state_keys(cfg), name


@pytest.mark.e2e
def test_a_guarded_federation_measures_every_message_after_the_first_training_and_saves_what_it_kept(
    tiny_llama_dir, tmp_path
):
    """FedAvg with the guard through the real ServerApp and ClientApp (in-process simulation, tiny model): the copy
    survives between messages, the share kept reaches metrics.jsonl, and a client that kept less than the server's
    adapter at the end saves the adapter it was evaluated with."""
    import json

    from test_toy_strategy import config, run

    run_dir = tmp_path / "run"
    settings = {**config(tiny_llama_dir, run_dir), **GUARDED, "guard.shares": "0,0.5,1", "guard.examples": 2}
    settings["train.learning-rate"] = 0.05
    run(settings)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    clients = [r for r in rows if r["node"] is not None]
    first = [r for r in clients if r["round"] == 1]  # nothing trained before round 1's training: nothing measured
    assert len(first) == 3 and all(r["train_guard_share"] == 1.0 and "train_guard_own_loss" not in r for r in first)
    # every later message (round 1's evaluation, round 2's training and evaluation) measured the shares
    assert len([r for r in clients if r["round"] == 2]) == 3
    assert all(r["guard_share"] == 1.0 and "guard_own_loss" not in r for r in clients if r["round"] == 0)
    for row in (r for r in clients if r["round"] > 0):
        for prefix in ("train_", "") if row["round"] == 2 else ("",):
            assert row[f"{prefix}guard_share"] in (0.0, 0.5, 1.0)
            assert np.isfinite(row[f"{prefix}guard_server_loss"]) and np.isfinite(row[f"{prefix}guard_own_loss"])
        if row["round"] == 2:  # the end: a client that kept less than the server's adapter saved what it kept
            kept_own = row["guard_share"] < 1.0
            assert (run_dir / "client-adapters" / f"partition-{row['partition_id']}").exists() == kept_own


def test_the_strategys_adapter_is_kept_only_where_it_wins_by_the_margin_the_examples_resolve():
    alone = [1.0, 2.0, 3.0, 4.0]
    clearly = [0.5, 1.5, 2.5, 3.5]  # lower on every example by 0.5: no spread, resolved at any margin
    assert strategy_kept(clearly, alone, 1.0) and strategy_kept(clearly, alone, 10.0)
    noisy = [0.0, 2.5, 2.0, 4.3]  # lower on the mean (-0.3), by less than a standard error of the differences
    assert strategy_kept(noisy, alone, 0.0) and not strategy_kept(noisy, alone, 1.0)
    assert not strategy_kept([1.1, 2.1, 3.1, 4.1], alone, 0.0)  # higher everywhere
    assert strategy_kept(alone, alone, 1.0)  # a tie with nothing between them: the strategy's (the same losses)
    assert not strategy_kept([float("nan"), 0.0, 0.0, 0.0], alone, 0.0)
    assert strategy_kept(clearly, [float("nan"), 2.0, 3.0, 4.0], 1.0)
    with pytest.raises(ValueError, match="same examples"):
        strategy_kept([1.0], alone, 1.0)


@pytest.mark.parametrize(
    "settings, guarded",
    [
        ({"strategy": "simgrad", "data.validation-fraction": 0.2}, True),
        ({"strategy": "atlas", "data.validation-fraction": 0.2}, True),
        ({"strategy": "mira", "data.validation-fraction": 0.2}, True),
        ({"strategy": "simgrad"}, False),  # no validation split to choose on: off, not an error
        ({"strategy": "simgrad", "data.validation-fraction": 0.2, "data.eval-split": "validation"}, False),
        ({"strategy": "simgrad", "data.validation-fraction": 0.2, "guard.enabled": False}, False),
        ({"strategy": "fedavg", "data.validation-fraction": 0.2}, False),
        ({"strategy": "fedavg-dual", "data.validation-fraction": 0.2}, False),  # its personal LoRA is its guard
        ({"strategy": "fedavg", "data.validation-fraction": 0.2, "guard.enabled": True}, True),
    ],
)
def test_the_guard_is_on_by_default_for_the_strategies_that_can_harm_a_member(settings, guarded):
    cfg = load_run_config(settings)
    assert cfg.guarded is guarded
    by_default = settings["strategy"] in ("simgrad", "atlas", "mira") and "guard.enabled" not in settings
    off_by_auto = by_default and not guarded
    why = cfg.unguarded_why()  # what the server logs where 'auto' left a strategy's guard off
    assert (why is not None) is off_by_auto
    if off_by_auto:
        assert "data.validation-fraction" in why or "data.eval-split" in why
    state_keys = strategy_spec(cfg.strategy).state_keys(cfg)
    assert (guard_state_key(cfg.guard.reference) in state_keys) is guarded
