"""Every adapter kind starts as the identity: a freshly attached adapter, begun from its own initial arrays, gives
exactly the base model's logits. Round 0 evaluates that model, which is why ``bench.compare`` measures round 0
once per seed and lets the other strategies of the seed borrow it (``eval.initial=false``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.adapters import ADAPTER_KINDS, ClientState, adapter_kind
from common.model import load_base_model
from strategies import load_run_config

IDS = torch.tensor([[1, 5, 9, 200, 31, 7, 42, 3], [8, 6, 4, 2, 10, 12, 14, 16]])
# settings that fit the tiny two-block model of ``tiny_llama_dir``
TINY = {
    "pqlora.blocks": 2,
    "experts.k-max": 3,
    "experts.r": 2,
    "sublora.intrinsic-dim": 64,
    "sublora.r": 2,
    "personal.r": 2,
}


def route(adapter) -> None:
    """VEMoE's experts act only on the tokens routed to them: route to two of them, as a client does."""
    if hasattr(adapter, "route"):
        adapter.route([0, 2], [0.5, 0.5])


@pytest.mark.parametrize("name", sorted(ADAPTER_KINDS))
def test_a_fresh_adapter_gives_the_base_models_logits(tiny_llama_dir, name):
    from flwr.app import RecordDict

    base = load_base_model(str(tiny_llama_dir), quantization="fp32", device="cpu")
    with torch.no_grad():
        reference = base(IDS).logits.clone()
    kind = adapter_kind(name)
    adapter = kind(base, load_run_config(dict(TINY)))
    adapter.begin(ClientState(RecordDict(), kind.state_keys), adapter.initial)
    route(adapter)
    with torch.no_grad():
        logits = adapter.model(IDS).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-6)
    # and the adapter is in the forward pass: begun from other arrays of the same shapes, the logits move
    rng = np.random.default_rng(0)
    moved = {k: (v + rng.standard_normal(v.shape) * 0.5).astype(v.dtype) for k, v in adapter.initial.items()}
    adapter.begin(ClientState(RecordDict(), kind.state_keys), moved)
    route(adapter)
    with torch.no_grad():
        assert not torch.allclose(adapter.model(IDS).logits, reference, atol=1e-3)
