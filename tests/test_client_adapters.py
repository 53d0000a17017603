"""Client-side PQ-LoRA state: one process serves several virtual clients with ONE model, so each client's local
P/Q, gates and last global part live in its own ``ClientState`` and never leak into another client; state under
an undeclared key is refused; SimGrad's client half aligns what is sent."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from common.adapters import ClientState, UndeclaredStateError
from common.adapters.pqlora import PQLoraAdapter, get_pq_arrays
from common.data import Example
from common.model import load_base_model, load_tokenizer
from common.training import train_round
from strategies import load_run_config

EXAMPLES = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8)]


def context(node_id: int) -> ClientState:
    ctx = Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})
    return ClientState(ctx.state, PQLoraAdapter.state_keys)


@pytest.fixture()
def adapter(tiny_llama_dir):
    cfg = load_run_config({"strategy": "simgrad", "pqlora.r": 2, "pqlora.blocks": 2, "simgrad.route-budget": 1})
    return (
        PQLoraAdapter(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), cfg),
        load_tokenizer(str(tiny_llama_dir)),
        cfg,
    )


def test_local_state_is_per_client_and_only_active_blocks_travel(adapter):
    pq, tokenizer, cfg = adapter
    alice, bob = context(1), context(2)
    received = {k: np.full_like(v, 0.01) for k, v in pq.initial.items()}
    pq.begin(alice, received)
    pq.set_active_blocks([1])  # what SimGrad's client half does with its group's routing
    pq.prepare_training()
    train_round(pq.model, tokenizer, EXAMPLES, cfg.train_settings(), 0.05, seed=0)
    sent, metrics = pq.outgoing()
    pq.end(alice)
    assert sorted(sent) == sorted(k for k in pq.initial if k.startswith("block1."))  # routing: block 0 stays home
    assert metrics["active_blocks"] == [1] and len(metrics["beta"]) == 2
    assert np.abs(sent["block1.q_proj.P"]).sum() > 0

    pq.begin(bob, None)  # a fresh client starts from zeros, not from alice's training
    assert all(not np.any(v) for v in pq.outgoing()[0].values())
    pq.end(bob)

    pq.begin(alice, None)  # alice gets her own local P/Q and her last global part back
    pq.set_active_blocks([1])
    again, _ = pq.outgoing()
    np.testing.assert_allclose(again["block1.q_proj.P"], sent["block1.q_proj.P"], atol=1e-6)
    np.testing.assert_allclose(get_pq_arrays(pq.model, "global")["block0.q_proj.P"], 0.01)
    block0 = get_pq_arrays(pq.model, "local")["block0.q_proj.P"]
    assert not np.any(block0)  # the inactive block was not trained


def test_alignment_reports_errors_once_a_reference_exists(adapter):
    from types import SimpleNamespace

    from strategies.simgrad import SimGradClient

    pq, tokenizer, cfg = adapter
    simgrad, rt = SimGradClient(cfg), SimpleNamespace(adapter=pq)
    ctx = context(3)
    pq.begin(ctx, None)
    pq.prepare_training()
    train_round(pq.model, tokenizer, EXAMPLES, cfg.train_settings(), 0.05, seed=0)
    _, first = simgrad.outgoing(rt, pq.outgoing()[0])
    assert "align_error_before" not in first  # round 1: the global part is still zero, nothing to align to
    rng = np.random.default_rng(0)
    pq.begin(ctx, {k: rng.normal(size=v.shape).astype(np.float32) for k, v in pq.initial.items()})
    _, later = simgrad.outgoing(rt, pq.outgoing()[0])
    assert later["align_error_after"] <= later["align_error_before"]


def test_simgrad_routes_pqlora_to_the_blocks_its_group_was_sent(adapter):
    """The routed blocks travel in SimGrad's own instruction key (``strategies.simgrad.wire``) and reach PQ-LoRA
    through SimGrad's client half (``ready``), not through the generic handler; every message starts unrouted."""
    from types import SimpleNamespace

    from strategies.simgrad import SimGradClient
    from strategies.simgrad.wire import SimGradWire

    pq, _, cfg = adapter
    simgrad, rt = SimGradClient(cfg), SimpleNamespace(adapter=pq)
    pq.begin(context(4), None)
    simgrad.ready(rt, SimGradWire(active_blocks=(1,)), training=True)
    assert pq.active_blocks == [1]
    assert sorted(pq.outgoing()[0]) == sorted(k for k in pq.initial if k.startswith("block1."))
    pq.begin(context(4), None)  # the next message: every block until its group's routing says otherwise
    assert pq.active_blocks is None
    simgrad.ready(rt, None, training=False)  # an evaluation carries no routing
    assert pq.active_blocks is None and sorted(pq.received()) == sorted(pq.initial)


def test_client_state_refuses_undeclared_keys():
    state = ClientState(RecordDict(), ("pqlora.local",))
    state.put("pqlora.local", {"x": np.ones(2, np.float32)})
    np.testing.assert_array_equal(state.get("pqlora.local")["x"], 1.0)
    with pytest.raises(UndeclaredStateError, match="not declared"):
        state.put("myadapter.extra", {"x": np.ones(2, np.float32)})
    with pytest.raises(UndeclaredStateError):
        state.get("simgrad.ema")


def test_client_state_reports_the_bytes_it_keeps():
    records = RecordDict()
    state = ClientState(records, ("pqlora.local", "simgrad.ema"))
    assert state.nbytes() == 0  # a client that has kept nothing yet (FedAvg's, always)
    state.put("pqlora.local", {"p": np.ones((8, 8), np.float32)})
    one = state.nbytes()
    assert 256 <= one < 256 + 512  # the 256 bytes of data and the array's header
    state.put("simgrad.ema", {"e": np.ones((8, 8), np.float32)})
    records["config"] = ConfigRecord({"other": 1})  # records outside the declared keys are not the client's arrays
    assert state.nbytes() == 2 * one


def test_adapters_detach_back_to_the_untouched_base(tiny_llama_dir):
    """Swapping adapters on one shared base (another kind or rank) leaves the base exactly as loaded."""
    import torch

    from common.adapters.lora import LoraAdapter
    from common.adapters.pqlora import PQLoraLinear

    base = load_base_model(str(tiny_llama_dir), "fp32", "cpu")
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = base(tokens).logits
    for flat in ({"lora.r": 2}, {"strategy": "simgrad", "pqlora.r": 2, "pqlora.blocks": 2, "simgrad.route-budget": 1}):
        cfg = load_run_config(flat)
        kind = PQLoraAdapter if cfg.adapter == "pqlora" else LoraAdapter
        attached = kind(base, cfg)
        with torch.no_grad():  # a non-zero adapter changes the output while attached
            for p in attached.model.parameters():
                if p.requires_grad:
                    p.fill_(0.05)
            assert not torch.allclose(attached.model(tokens).logits, before)
        base = attached.detach()
        assert not any(isinstance(m, PQLoraLinear) for m in base.modules()) and not hasattr(base, "peft_config")
        with torch.no_grad():
            torch.testing.assert_close(base(tokens).logits, before)


def test_an_adapter_kind_missing_what_its_base_leaves_to_it_is_refused_when_registered():
    from contextlib import nullcontext

    from common.adapters import ADAPTER_KINDS, AdapterBase
    from common.adapters.base import checked_kind

    class NoLoad(AdapterBase):
        name = "no-load"

        def attach(self, base, cfg):
            return base

        def arrays(self):
            return {}

        def disabled(self):
            return nullcontext()

        def detach(self):
            return self.model

    with pytest.raises(TypeError, match=r"adapter kind NoLoad: define load \(or a begin of its own\)"):
        checked_kind(NoLoad)

    class OwnBegin(NoLoad):
        name = "own-begin"

        def begin(self, state, received):
            self._received = received or self.initial

    assert checked_kind(OwnBegin) is OwnBegin

    class Unfinished(AdapterBase):
        def attach(self, base, cfg):
            return base

    with pytest.raises(TypeError, match=r"Unfinished: define name, arrays, detach, disabled, load"):
        checked_kind(Unfinished)
    assert all(checked_kind(kind) is kind for kind in ADAPTER_KINDS.values())
