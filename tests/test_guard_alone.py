"""The guard's reference is what training alone would reach (``guard.reference = "alone"``,
``client_app.do_no_harm``): beside the strategy's adapter a client trains the local-only baseline's LoRA, exactly
as a local-only client trains it, never sends it, and is evaluated with it where the strategy's adapter is worse
on its validation examples. On a tiny random Llama: a strategy on LoRA (FedAvg) and one on PQ-LoRA with a personal
LoRA (SimGrad's adapter), whose kept state survives the swaps."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from client_app.do_no_harm import alone_loss, alone_reference, keep_better, train_alone
from client_app.runtime import ClientRuntime, LoadedModel
from common.adapters import ClientState, adapter_kind
from common.config import ConfigError
from common.data import ClientData, Example
from common.guard import GUARD_ALONE_KEY, GUARD_STATE_KEY
from common.model import load_base_model, load_tokenizer
from common.training import round_learning_rate, train_round
from strategies import load_run_config, strategy_spec
from strategies.client import StrategyClient

TRAIN = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8)]
VALIDATION = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8, 16)]
ALONE = {
    "guard.enabled": True,
    "data.validation-fraction": 0.2,
    "lora.r": 4,
    "pqlora.blocks": 2,
    "train.local-steps": 3,
    "train.batch-size": 2,
    "train.learning-rate": 0.05,
    "num-server-rounds": 2,
    "model.quantization": "fp32",
    "model.device": "cpu",
}


def runtime(model_dir, settings: dict) -> tuple[Context, ClientRuntime]:
    """One client of ``settings``'s run on the tiny model, as ``get_runtime`` builds it."""
    flat = {**ALONE, "model.name": str(model_dir), **settings}
    cfg = load_run_config(flat).for_model(str(model_dir))
    loaded = LoadedModel(str(model_dir), load_base_model(str(model_dir), "fp32", "cpu"), None, 1)
    loaded.tokenizer = load_tokenizer(str(model_dir))
    adapter = loaded.attach(adapter_kind(cfg.adapter), cfg)
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config=flat)
    state = ClientState(context.state, strategy_spec(cfg.strategy).state_keys(cfg))
    data = ClientData(TRAIN, TRAIN, validation=VALIDATION)
    return context, ClientRuntime(cfg, loaded, adapter, StrategyClient(cfg), state, 0, 1, {}, data)


def local_only_round(model_dir, seed: int) -> dict[str, np.ndarray]:
    """Round 1 of a local-only client of the same run: its LoRA after the round."""
    _, rt = runtime(model_dir, {"strategy": "local", "guard.enabled": False})
    rt.adapter.begin(rt.state, rt.adapter.initial)
    rt.adapter.prepare_training()
    lr = round_learning_rate(rt.cfg.train_settings(), 1, rt.cfg.num_server_rounds)
    train_round(rt.model, rt.tokenizer, TRAIN, rt.cfg.train_settings(), lr, seed=seed)
    return rt.adapter.outgoing()[0]


@pytest.mark.parametrize("strategy", ["fedavg", "simgrad"])
def test_the_adapter_trained_alone_is_the_local_only_clients_adapter(tiny_llama_dir, strategy):
    context, rt = runtime(tiny_llama_dir, {"strategy": strategy})
    assert alone_reference(rt.cfg)
    assert GUARD_ALONE_KEY in rt.state.declared and GUARD_STATE_KEY not in rt.state.declared
    train_alone(context, rt, server_round=1, seed=5)
    kept = rt.state.get(GUARD_ALONE_KEY)
    assert kept is not None
    expected = local_only_round(tiny_llama_dir, seed=5)
    assert set(kept) == set(expected)
    for name in expected:
        np.testing.assert_allclose(kept[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(np.abs(v).max() > 0 for k, v in kept.items() if "lora_B" in k)  # it trained (B starts at zero)


def test_the_strategys_kept_state_survives_the_swaps(tiny_llama_dir):
    """SimGrad's PQ-LoRA with a personal LoRA keeps its state in the client's; measuring and training the adapter
    trained alone (module surgery on the shared base) leaves that state and the strategy's adapter as they were."""
    context, rt = runtime(tiny_llama_dir, {"strategy": "simgrad"})
    rt.adapter.begin(rt.state, rt.adapter.initial)
    rt.adapter.prepare_training()
    train_round(rt.model, rt.tokenizer, TRAIN, rt.cfg.train_settings(), 0.05, seed=1)
    rt.adapter.end(rt.state)
    before = {key: rt.state.get(key) for key in rt.state.declared if rt.state.get(key) is not None}
    train_alone(context, rt, server_round=1, seed=1)
    losses = alone_loss(context, rt)
    assert losses is not None and all(count > 0 for _, count in losses)
    assert rt.adapter.name == rt.cfg.adapter  # the strategy's kind is attached back
    for key, arrays in before.items():
        now = rt.state.get(key)
        assert now is not None and set(now) == set(arrays), key
        assert all(np.array_equal(now[n], arrays[n]) for n in arrays), key


def test_a_client_is_evaluated_with_the_adapter_trained_alone_where_the_strategys_is_worse(tiny_llama_dir):
    context, rt = runtime(tiny_llama_dir, {"strategy": "fedavg"})
    assert alone_loss(context, rt) is None  # nothing trained alone yet
    assert keep_better(context, rt, None) == {"guard_share": 1.0}
    train_alone(context, rt, server_round=1, seed=0)
    alone = alone_loss(context, rt)
    assert alone is not None
    rng = np.random.default_rng(0)
    harmful = {k: v + rng.normal(scale=2.0, size=v.shape).astype(np.float32) for k, v in rt.adapter.initial.items()}
    rt.adapter.begin(rt.state, harmful)  # the federation's adapter: far from anything this client learnt
    metrics = keep_better(context, rt, alone)
    assert metrics["guard_share"] == 0.0 and metrics["guard_own_loss"] < metrics["guard_server_loss"]
    kept = rt.state.get(GUARD_ALONE_KEY)
    assert kept is not None
    now = rt.adapter.outgoing()[0]  # what it is evaluated with now: the adapter trained alone
    assert all(np.array_equal(now[k], kept[k]) for k in kept)


def test_a_client_keeps_the_strategys_adapter_where_it_is_better(tiny_llama_dir):
    context, rt = runtime(tiny_llama_dir, {"strategy": "fedavg"})
    train_alone(context, rt, server_round=1, seed=0)
    alone = alone_loss(context, rt)
    kept = rt.state.get(GUARD_ALONE_KEY)
    assert alone is not None and kept is not None
    # the federation's adapter: the one trained alone, trained further on examples like the validation ones
    rt.adapter.begin(rt.state, kept)
    rt.adapter.prepare_training()
    train_round(rt.model, rt.tokenizer, VALIDATION, rt.cfg.train_settings(), 0.05, seed=1)
    better = rt.adapter.outgoing()[0]
    metrics = keep_better(context, rt, alone)
    assert metrics["guard_share"] == 1.0 and metrics["guard_server_loss"] < metrics["guard_own_loss"]
    now = rt.adapter.outgoing()[0]
    assert all(np.array_equal(now[k], better[k]) for k in better)


def test_local_only_has_no_reference_to_train_beside_itself():
    cfg = load_run_config({**ALONE, "strategy": "local"})
    assert not alone_reference(cfg)


def test_mixing_shares_need_the_clients_own_adapter_as_the_reference():
    with pytest.raises(ConfigError, match="guard.shares"):
        load_run_config({**ALONE, "strategy": "fedavg", "guard.shares": "0,0.5,1"})
    cfg = load_run_config({**ALONE, "strategy": "fedavg", "guard.shares": "0,0.5,1", "guard.reference": "own"})
    assert cfg.guard.shares == [0.0, 0.5, 1.0]
    with pytest.raises(ConfigError, match="guard.reference"):
        load_run_config({**ALONE, "strategy": "fedavg", "guard.reference": "mine"})


@pytest.mark.e2e
def test_a_guarded_federation_measures_the_local_only_adapter_and_evaluates_with_the_better(tiny_llama_dir, tmp_path):
    """FedAvg with the guard through the real ServerApp and ClientApp (in-process simulation, tiny model) beside a
    local-only run of the same clients: the validation loss each guarded client measured for its adapter trained
    alone is the local-only client's own loss on those validation examples, every client chose one of the two
    at every evaluation after training, nothing of the adapter trained alone was sent (the train replies carry
    the strategy's metrics only), and a client that chose it at the end saved it."""
    import json

    from test_toy_strategy import config, run

    def rows(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["node"] is not None]

    common = {"data.validation-fraction": 0.2, "train.learning-rate": 0.05, "lora.r": 4}
    guarded_dir, local_dir = tmp_path / "guarded", tmp_path / "local"
    run(
        {
            **config(tiny_llama_dir, guarded_dir),
            **common,
            "strategy": "fedavg",
            "guard.enabled": True,
            "guard.examples": 2,
        }
    )
    # local-only, evaluated on those validation examples: what the adapter trained alone should measure
    run(
        {
            **config(tiny_llama_dir, local_dir),
            **common,
            "strategy": "local",
            "data.eval-split": "validation",
            "eval.max-examples": 2,
            "eval.generate-examples": 1,
        }
    )
    guarded, local = rows(guarded_dir), rows(local_dir)
    assert all(r["guard_share"] == 1.0 and "guard_own_loss" not in r for r in guarded if r["round"] == 0)
    assert not any(k.startswith("train_guard") for r in guarded for k in r)
    final = {r["partition_id"]: r for r in guarded if r["round"] == 2}
    alone = {r["partition_id"]: r["eval_loss"] for r in local if r["round"] == 2}
    assert len(final) == 3 and set(alone) == set(final)
    for p, row in final.items():
        assert row["guard_share"] in (0.0, 1.0)
        assert row["guard_own_loss"] == pytest.approx(alone[p], rel=1e-4), p
        assert np.isfinite(row["guard_server_loss"])
        chose_alone = row["guard_share"] == 0.0
        assert chose_alone == (row["guard_own_loss"] < row["guard_server_loss"])
        assert (guarded_dir / "client-adapters" / f"partition-{p}").exists() == chose_alone
