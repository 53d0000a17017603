"""ATLAS's client half on a tiny random Llama: a client attaches its own per-layer ranks (scale alpha / r kept),
takes its slots of the group's padded arrays, trains, and sends its slots padded back with slot masks; the server's
copy of such an adapter loads in peft with the same shapes."""

from __future__ import annotations

import numpy as np
from flwr.app import Context, RecordDict

from client_app.runtime import ClientRuntime, LoadedModel
from common.adapters import ClientState, adapter_kind
from common.adapters.lora import LoraAdapter
from common.adapters.lora import ranks as lora_ranks
from common.data import ClientData, Example
from common.messages import decode
from common.model import load_base_model, load_tokenizer
from common.training import train_round
from strategies import load_run_config, strategy_spec
from strategies.atlas import AtlasSection
from strategies.atlas.wire import AtlasWire

EXAMPLES = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8)]


def runtime(tiny_llama_dir, node_config=None, **settings) -> ClientRuntime:
    flat = {"strategy": "atlas", "lora.r": 4, "lora.alpha": 8, "atlas.memory-mb": "3", **settings}
    cfg = load_run_config(flat)
    loaded = LoadedModel(str(tiny_llama_dir), load_base_model(str(tiny_llama_dir), "fp32", "cpu"), None, 1)
    loaded.tokenizer = load_tokenizer(str(tiny_llama_dir))
    adapter = loaded.attach(adapter_kind(cfg.adapter), cfg)
    ctx = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    spec = strategy_spec(cfg.strategy)
    state = ClientState(ctx.state, spec.state_keys(cfg))
    return ClientRuntime(
        cfg, loaded, adapter, spec.client(cfg), state, 0, 1, node_config or {}, ClientData(EXAMPLES, EXAMPLES)
    )


def test_own_ranks_are_attached_trained_and_sent_padded_with_masks(tiny_llama_dir, tmp_path):
    from peft import PeftModel

    rt = runtime(tiny_llama_dir)
    paths = sorted(lora_ranks.layers(rt.adapter.initial))
    own = {p: (2 if i % 2 else 6) for i, p in enumerate(paths)}
    wire = {p: 8 for p in paths}
    sent = {"lora-ranks": ",".join(str(own[p]) for p in paths), "wire-ranks": ",".join("8" for _ in paths)}
    config = decode(AtlasWire, sent)  # as the instruction arrives
    client = rt.strategy
    client.configure(rt, config)
    assert lora_ranks.ranks(rt.adapter.initial) == own  # the client's own adapter, not the wire's
    scales = [m.scaling["default"] for m in rt.adapter.model.modules() if isinstance(getattr(m, "scaling", None), dict)]
    assert len(scales) == len(paths) and set(scales) == {8 / 4}  # alpha / r of the run, whatever the layer's rank
    reference = client.wire_reference(rt, config)
    assert lora_ranks.ranks(lora_ranks.without_masks(reference)) == wire
    rng = np.random.default_rng(0)
    received = {k: rng.normal(scale=0.1, size=v.shape).astype(np.float32) for k, v in reference.items()}
    start = client.start(rt, received)
    assert lora_ranks.ranks(start) == own
    a_name = lora_ranks.layers(start)[paths[0]][0]
    np.testing.assert_array_equal(start[a_name], received[a_name][: own[paths[0]]])  # its slots of the group's
    rt.adapter.begin(rt.state, start)
    rt.adapter.prepare_training()
    settings = rt.cfg.train_settings()
    train_round(rt.adapter.model, rt.tokenizer, EXAMPLES, settings, 0.01, seed=0)
    trained, _ = rt.adapter.outgoing()
    sent, _ = client.outgoing(rt, trained)
    assert {k: v.shape for k, v in sent.items()} == {k: v.shape for k, v in reference.items()}
    for path, (a, b) in lora_ranks.layers(lora_ranks.without_masks(sent)).items():
        assert not sent[a][own[path] :].any() and not sent[b][:, own[path] :].any()  # padding stays zero
        np.testing.assert_array_equal(sent[lora_ranks.MASK_PREFIX + path], np.arange(8) < own[path])
    assert any(np.abs(sent[b]).sum() > 0 for _, b in lora_ranks.layers(lora_ranks.without_masks(sent)).values())

    out = LoraAdapter.save_server_copy(lora_ranks.without_masks(sent), rt.cfg, str(tiny_llama_dir), tmp_path / "a")
    loaded = PeftModel.from_pretrained(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), str(out))
    shapes = {n: tuple(p.shape) for n, p in loaded.named_parameters() if "lora_A" in n}
    assert sorted(s[0] for s in shapes.values()) == sorted(wire.values())


def test_without_ranks_the_client_uses_the_runs_adapter_and_a_nodes_budget_wins(tiny_llama_dir):
    rt = runtime(tiny_llama_dir, {"memory-mb": 2.5})
    rt.strategy.configure(rt, None)
    assert set(lora_ranks.ranks(rt.adapter.initial).values()) == {4}
    assert rt.strategy.wire_reference(rt, None) is rt.adapter.initial
    assert rt.cfg.section(AtlasSection).budget(0, rt.node_config) == 2.5  # over the run's atlas.memory-mb = 3
    assert rt.cfg.section(AtlasSection).budget(0, {}) == 3.0


def test_a_personal_lora_beside_the_clusters_trains_stays_and_leaves_the_fingerprint_as_it_was(tiny_llama_dir):
    """``atlas.personal-lora``: the client's adapter is the cluster's LoRA (its own ranks) beside a personal LoRA
    that trains, is kept in its state and is never sent; the fingerprint is taken without it, so what the client
    trained on its own does not move it between clusters."""
    from common.adapters.personal import PERSONAL_STATE

    rt = runtime(tiny_llama_dir, **{"atlas.personal-lora": True})
    assert rt.adapter.name == "lora-dual" and PERSONAL_STATE in rt.state.declared
    before, _ = rt.strategy.report(rt, rt.state, 1)
    paths = sorted(lora_ranks.layers(rt.adapter.initial))
    own = {p: 2 for p in paths}
    sent = {"lora-ranks": ",".join("2" for _ in paths), "wire-ranks": ",".join("4" for _ in paths)}
    rt.strategy.configure(rt, decode(AtlasWire, sent))
    assert rt.adapter.name == "lora-dual" and lora_ranks.ranks(rt.adapter.initial) == own
    rt.adapter.begin(rt.state, rt.strategy.start(rt, None) or rt.adapter.initial)
    rt.adapter.prepare_training()
    train_round(rt.adapter.model, rt.tokenizer, EXAMPLES, rt.cfg.train_settings(), 0.05, seed=0)
    trained, _ = rt.adapter.outgoing()
    outgoing, _ = rt.strategy.outgoing(rt, trained)
    rt.adapter.end(rt.state)
    assert not any("personal" in name for name in outgoing)  # nothing of it travels
    personal = rt.state.get(PERSONAL_STATE)
    assert personal is not None and any(np.abs(v).max() > 0 for k, v in personal.items() if "lora_B" in k)
    after, _ = rt.strategy.report(rt, rt.state, 1)  # same round: the same batches and noise
    np.testing.assert_allclose(after["fingerprint"], before["fingerprint"], rtol=1e-5, atol=1e-7)
    assert rt.state.get(PERSONAL_STATE) is not None
    kept = rt.state.get(PERSONAL_STATE)
    assert all(np.array_equal(kept[k], personal[k]) for k in personal)  # the report left it as trained


def test_a_mira_client_with_a_personal_lora_saves_both_of_its_adapters(tiny_llama_dir, tmp_path):
    """MIRA's stepped LoRA is the client's only copy: with ``mira.personal-lora`` the client saves it (PEFT, as
    without the personal LoRA) and its personal LoRA beside it."""
    from peft import PeftModel

    from strategies.client import save_whole_adapter

    rt = runtime(tiny_llama_dir, **{"strategy": "mira", "mira.personal-lora": True})
    assert rt.adapter.name == "lora-dual"
    rt.adapter.begin(rt.state, rt.strategy.start(rt, None))
    rt.adapter.prepare_training()
    train_round(rt.adapter.model, rt.tokenizer, EXAMPLES, rt.cfg.train_settings(), 0.05, seed=0)
    out = save_whole_adapter(rt, tmp_path / "client")
    assert out is not None
    for directory in (tmp_path / "client", tmp_path / "client" / "personal-lora"):
        loaded = PeftModel.from_pretrained(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), str(directory))
        assert any("lora_B" in n and p.abs().sum() > 0 for n, p in loaded.named_parameters()), directory
