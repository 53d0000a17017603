"""The personal LoRA of the dual-path kinds (``fedavg-dual``'s ``lora-dual``, SimGrad's ``pqlora-dual``, VEMoE's
``experts-dual``): it trains
beside the travelling adapter at its own learning rate, is never part of what is sent, lives in the client's node
state (one process, several clients: no leaks), exports as a PEFT directory; the config picks the kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from common.adapters import ClientState, adapter_kind
from common.adapters.personal import PERSONAL_STATE, get_personal_arrays, set_personal_arrays
from common.adapters.pqlora import get_pq_arrays
from common.config import ConfigError
from common.data import Example
from common.model import load_base_model, load_tokenizer
from common.training import train_round
from strategies import load_run_config, strategy_spec

EXAMPLES = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8)]
CONFIGS = {
    "fedavg-dual": {"strategy": "fedavg-dual", "lora.r": 2, "personal.r": 4},
    "simgrad-lora": {"strategy": "simgrad", "simgrad.local-path": "lora", "pqlora.r": 2, "pqlora.blocks": 2},
    "vemoe-personal": {"strategy": "vemoe", "vemoe.personal-lora": True, "experts.k-max": 3, "experts.r": 2},
}


def begin(adapter, state: ClientState, received) -> None:
    """Begin a message; VEMoE's experts train only on the tokens routed to them: route to two, as its client does."""
    adapter.begin(state, received)
    if hasattr(adapter, "route"):
        adapter.route([0, 2], [0.5, 0.5])


def node_state(node_id: int, keys: tuple[str, ...]) -> ClientState:
    ctx = Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})
    return ClientState(ctx.state, keys)


def build(tiny_llama_dir, flat: dict):
    cfg = load_run_config(flat)
    kind = adapter_kind(cfg.adapter)
    adapter = kind(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), cfg)
    return adapter, cfg, strategy_spec(cfg.strategy).state_keys(cfg)


def personal_b_norm(model) -> float:
    return float(sum(np.abs(v).sum() for k, v in get_personal_arrays(model).items() if "lora_B" in k))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_personal_lora_trains_stays_home_and_survives_node_state(tiny_llama_dir, name):
    adapter, cfg, keys = build(tiny_llama_dir, CONFIGS[name])
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert PERSONAL_STATE in keys
    alice, bob = node_state(1, keys), node_state(2, keys)
    received = {k: np.full_like(v, 0.01) for k, v in adapter.initial.items()}

    begin(adapter, alice, received)
    adapter.prepare_training()
    lr = cfg.train_settings().learning_rate
    train_round(adapter.model, tokenizer, EXAMPLES, cfg.train_settings(), lr, seed=0, lr_groups=adapter.lr_groups())
    sent, _ = adapter.outgoing()
    trained = get_personal_arrays(adapter.model)
    adapter.end(alice)
    assert sorted(sent) == sorted(adapter.initial)  # what travels: the global path's names only
    # peft names both LoRAs alike (the adapter name is not in the state dict): compare values, not names
    assert not any(k in trained and np.array_equal(sent[k], trained[k]) for k in sent)
    assert max(np.abs(sent[k] - received[k]).max() for k in sent) > 0  # the travelling path trained too
    assert personal_b_norm(adapter.model) > 0  # the personal LoRA trained (B starts at zero)

    adapter.begin(bob, received)  # another client on the same model starts from the initial personal LoRA
    assert personal_b_norm(adapter.model) == 0
    adapter.end(bob)

    adapter.begin(alice, received)  # alice's comes back from her node state, exactly
    for key, value in get_personal_arrays(adapter.model).items():
        np.testing.assert_array_equal(value, trained[key])
    assert set(alice.get(PERSONAL_STATE)) == set(trained)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_path_steps_at_its_own_rate_and_exports_as_peft(tiny_llama_dir, tmp_path, name):
    from peft import PeftModel, get_peft_model_state_dict

    flat = {**CONFIGS[name], "personal.learning-rate": 0.5}
    adapter, cfg, _ = build(tiny_llama_dir, flat)
    begin(adapter, node_state(1, adapter.state_keys), adapter.initial)
    adapter.prepare_training()
    groups = adapter.lr_groups()
    trainable = [p for p in adapter.model.parameters() if p.requires_grad]
    assert sum(len(ps) for ps, _ in groups) == len(trainable)
    assert groups[1][1] == pytest.approx(0.5 / cfg.train_settings().learning_rate)

    rng = np.random.default_rng(0)
    mine = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in get_personal_arrays(adapter.model).items()}
    set_personal_arrays(adapter.model, mine)
    out = adapter.save(tmp_path / "client", "tiny")
    assert out is not None and (tmp_path / "client" / "personal-lora" / "adapter_config.json").exists()
    base = load_base_model(str(tiny_llama_dir), "fp32", "cpu")
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, str(tmp_path / "client" / "personal-lora")))
    assert set(loaded) == set(mine)  # peft's own names, on a plain base model
    for key, value in mine.items():
        np.testing.assert_array_equal(loaded[key].numpy(), value)


def test_pq_dual_starts_the_pq_path_from_what_the_server_sent(tiny_llama_dir):
    adapter, _, keys = build(tiny_llama_dir, CONFIGS["simgrad-lora"])
    state = node_state(1, keys)
    received = {k: np.full_like(v, 0.02) for k, v in adapter.initial.items()}
    adapter.begin(state, received)
    np.testing.assert_allclose(get_pq_arrays(adapter.model, "local")["block0.q_proj.P"], 0.02)
    with adapter.disabled():  # the probe's pure base: neither the PQ path nor the personal LoRA
        ids = torch.tensor([[1, 2, 3]])
        pure = adapter.model(input_ids=ids).logits
    base = load_base_model(str(tiny_llama_dir), "fp32", "cpu")
    torch.testing.assert_close(pure, base(input_ids=ids).logits)
    detached = adapter.detach()
    assert not any("lora" in n or "P_L" in n for n, _ in detached.named_parameters())


def test_the_dual_pool_travels_as_the_plain_pool_and_detaches_to_the_base(tiny_llama_dir):
    """The personal LoRA is invisible on the wire (the pool's names and initial experts are the plain pool's), the
    probe's pure base switches both paths off, and detaching gives the base back."""
    plain, _, _ = build(tiny_llama_dir, {"strategy": "vemoe", "experts.k-max": 3, "experts.r": 2})
    adapter, _, keys = build(tiny_llama_dir, CONFIGS["vemoe-personal"])
    assert adapter.name == "experts-dual" and sorted(adapter.initial) == sorted(plain.initial)
    for key, value in plain.initial.items():
        np.testing.assert_array_equal(adapter.initial[key], value)
    state = node_state(1, keys)
    begin(adapter, state, {k: np.full_like(v, 0.02) for k, v in adapter.initial.items()})
    rng = np.random.default_rng(1)
    mine = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in get_personal_arrays(adapter.model).items()}
    set_personal_arrays(adapter.model, mine)
    ids = torch.tensor([[1, 2, 3]])
    base = load_base_model(str(tiny_llama_dir), "fp32", "cpu")
    with torch.no_grad():
        reference = base(input_ids=ids).logits
        assert not torch.allclose(adapter.model(input_ids=ids).logits, reference, atol=1e-3)
        with adapter.disabled():
            torch.testing.assert_close(adapter.model(input_ids=ids).logits, reference)
        detached = adapter.detach()
        torch.testing.assert_close(detached(input_ids=ids).logits, reference)
    assert not any("lora" in n or "router" in n for n, _ in detached.named_parameters())


def test_the_config_picks_the_kind_and_names_bad_keys():
    assert load_run_config({"strategy": "simgrad"}).adapter == "pqlora-dual"  # the default local path
    assert load_run_config({"strategy": "simgrad", "simgrad.local-path": "pq"}).adapter == "pqlora"
    assert load_run_config({"strategy": "fedavg-dual"}).adapter == "lora-dual"
    assert load_run_config({"strategy": "vemoe"}).adapter == "experts-dual"  # the default: a personal LoRA
    assert load_run_config({"strategy": "vemoe", "vemoe.personal-lora": False}).adapter == "experts"
    with pytest.raises(ConfigError, match="simgrad.local-path"):
        load_run_config({"strategy": "simgrad", "simgrad.local-path": "prefix"})
    with pytest.raises(ConfigError, match="personal.r"):
        load_run_config({"strategy": "fedavg-dual", "personal.r": 0})


def _rows(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.parametrize(("name", "secure"), [("fedavg-dual", False), ("fedavg-dual", True), ("simgrad-lora", False)])
def test_a_dual_path_federation_sends_only_the_global_path(tiny_llama_dir, tmp_path, name, secure):
    """Through the real ServerApp/ClientApp (in-process simulation, tiny model): each reply is exactly the global
    path's size, the server's adapters have only its names, every client's loss falls, and each client saves its
    personal LoRA as a PEFT directory."""
    from test_toy_strategy import config, run

    from server_app.rundir import RunDirectory

    run_dir = tmp_path / "run"
    extra = {**CONFIGS[name], "secure": secure, "num-server-rounds": 2, "train.local-steps": 3}
    if name.startswith("simgrad"):
        extra.update({"simgrad.probe-model": str(tiny_llama_dir), "simgrad.probe-examples": 2, "pqlora.scaling": 4.0})
        extra["pqlora.learning-rate"] = 0.1
    run(config(tiny_llama_dir, run_dir, **extra))
    adapter, _, _ = build(tiny_llama_dir, {**CONFIGS[name], "secure": secure, "min-train-replies": 3})
    global_bytes = sum(v.nbytes for v in adapter.initial.values())
    rows = [r for r in _rows(run_dir) if r["node"] is not None]
    trained = [r for r in rows if r["round"] > 0]
    assert len(trained) == 6 and all(r["accepted"] for r in trained)
    if not secure:  # measured on the wire (secure mode reports the reference size: SecAgg+ sends masked vectors)
        assert all(r["bytes_up"] - r.get("report_bytes", 0) == global_bytes for r in trained), trained
    _, state = RunDirectory(run_dir).load_checkpoint()
    for arrays in state.values():
        assert set(arrays) <= set(adapter.initial), sorted(set(arrays) - set(adapter.initial))[:3]
    loss = {(r["partition_id"], r["round"]): r["eval_loss"] for r in rows}
    assert all(loss[p, 2] < loss[p, 0] for p in range(3)), loss
    kept = {r["state_bytes"] for r in trained}  # what each client keeps between rounds: the same shapes everywhere
    assert len(kept) == 1 and kept.pop() > 0, trained
    for p in range(3):
        assert (run_dir / "client-adapters" / f"partition-{p}" / "personal-lora" / "adapter_model.safetensors").exists()


def test_no_strategy_can_take_the_personal_sections_key():
    from pydantic import Field

    from common.config import Section
    from strategies.fedavg import FedAvgDual
    from strategies.registry import REGISTRY, StrategySpec, register

    class Clashing(FedAvgDual):
        name = "clashing"

    class ClashingSection(Section):
        key = "personal"
        r: int = Field(2)

    spec = StrategySpec(name="clashing", server=Clashing, client=strategy_spec("fedavg").client, adapter="lora")
    with pytest.raises(ValueError, match="'personal' is empty or taken"):
        register(StrategySpec(**{**spec.__dict__, "section": ClashingSection}))
    assert "clashing" not in REGISTRY


@pytest.mark.parametrize("local_path", ["pq", "lora"])
def test_the_gates_step_at_their_own_rate(tiny_llama_dir, local_path):
    """``pqlora.gate-learning-rate`` gives the gate logits a group of their own; at 0 (the default) they step with
    P/Q. A larger rate moves beta farther in the same steps (at the P/Q rate it barely leaves 0.5)."""
    from common.adapters.pqlora import PQLoraSection, get_gates

    flat = {"strategy": "simgrad", "simgrad.local-path": local_path, "pqlora.r": 2, "pqlora.blocks": 2}
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    moved = {}
    for gate_lr in (0.0, 1.0):
        adapter, cfg, keys = build(tiny_llama_dir, {**flat, "pqlora.gate-learning-rate": gate_lr})
        adapter.begin(node_state(1, keys), {k: np.full_like(v, 0.01) for k, v in adapter.initial.items()})
        adapter.prepare_training()
        groups = adapter.lr_groups()
        if gate_lr:
            gates, scale = groups[-1]
            assert len(gates) == 2 and scale == pytest.approx(1.0 / cfg.section(PQLoraSection).learning_rate)
            grouped = [id(p) for ps, _ in groups for p in ps]
            assert sorted(grouped) == sorted(id(p) for p in adapter.model.parameters() if p.requires_grad)
        else:  # no gate group: the pq path has none at all, the lora path only the personal LoRA's
            assert groups is None if local_path == "pq" else len(groups) == 2
        lr = cfg.train_settings().learning_rate
        train_round(adapter.model, tokenizer, EXAMPLES, cfg.train_settings(), lr, seed=0, lr_groups=groups)
        moved[gate_lr] = max(abs(b - 0.5) for b in get_gates(adapter.model))
    assert moved[1.0] > 2 * moved[0.0] > 0
