"""PQ-LoRA: the per-layer formula, surgery, width-independent P/Q names, local-state swaps, I/O, 4-bit training
and the data-free Procrustes alignment. Tiny random models only (seconds)."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from common.adapters.pqlora import (
    PQLoraConfig,
    PQLoraGates,
    PQLoraLinear,
    adapters_disabled,
    align_arrays,
    align_pq,
    attach_pqlora,
    block_grad_norms,
    find_decoder_blocks,
    get_gates,
    get_local_state,
    get_pq_arrays,
    load_pq_adapter,
    pq_num_floats,
    procrustes_rotation,
    reset_local_state,
    save_pq_adapter,
    seeded_orthonormal,
    set_local_state,
    set_pq_arrays,
    set_trainable_blocks,
    synthetic_anchors,
)
from common.model import load_base_model

CFG = PQLoraConfig(r=4, num_blocks=2, target_modules=("q_proj", "v_proj"), scaling=2.0, seed=7)
IDS = torch.tensor([[1, 5, 9, 200, 31, 7, 42, 3], [8, 6, 4, 2, 10, 12, 14, 16]])


def _load(tiny_llama_dir, quantization="fp32"):
    return load_base_model(str(tiny_llama_dir), quantization=quantization, device="cpu")


def _wide_qwen():
    """A second architecture, wider (48) and deeper (3 blocks) than the tiny Llama (32, 2 blocks)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    model.config.use_cache = False
    return model


def _random_arrays(model, part, rng, scale=0.3):
    return {k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in get_pq_arrays(model, part).items()}


@pytest.fixture()
def tiny(tiny_llama_dir):
    return attach_pqlora(_load(tiny_llama_dir), CFG)


# 1. the per-layer formula ------------------------------------------------------------------------------------


def test_layer_forward_matches_the_formula_and_disabled_is_the_base():
    torch.manual_seed(0)
    base = nn.Linear(12, 10)
    gates = PQLoraGates(2, gate_init=0.7)
    layer = PQLoraLinear(base, block=1, proj="q_proj", r=4, scaling=2.5, seed=3, gates=gates)
    x = torch.randn(2, 5, 12)
    assert torch.equal(layer(x), base(x))  # zero P/Q: the identity of the base at init
    rng = np.random.default_rng(0)
    vals = {n: rng.standard_normal(getattr(layer, n).shape).astype(np.float32) for n in ("P_L", "Q_L", "P_G", "Q_G")}
    with torch.no_grad():
        for n, v in vals.items():
            getattr(layer, n).copy_(torch.from_numpy(v))

    d = lambda t: t.detach().double().numpy()  # noqa: E731
    xs, A, B = d(x), d(layer.A), d(layer.B)
    beta = 1.0 / (1.0 + np.exp(-0.7))
    local = (xs @ A.T @ vals["P_L"].T + vals["Q_L"]) @ B.T
    glob = (xs @ A.T @ vals["P_G"].T + vals["Q_G"]) @ B.T
    expected = xs @ d(base.weight).T + d(base.bias) + 2.5 * ((1 - beta) * local + beta * glob)
    assert np.allclose(d(layer(x)), expected, atol=1e-5)

    layer.enabled = False
    assert torch.equal(layer(x), base(x))
    layer.enabled = True
    # bf16 base: the adapter runs in float32 and the result comes back in the base dtype.
    base.to(torch.bfloat16)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


# 2. surgery, gradients, shared gates --------------------------------------------------------------------------


def test_only_pq_and_gates_train_and_gates_are_not_duplicated(tiny):
    params = dict(tiny.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable == {n for n in params if n.endswith((".P_L", ".Q_L")) or n.startswith("pqlora_gates.")}
    assert sum(n.startswith("pqlora_gates.") for n in tiny.state_dict()) == CFG.num_blocks  # one gate per block
    assert sum(params[n].numel() for n in trainable) == pq_num_floats(CFG) + CFG.num_blocks
    assert get_gates(tiny) == [0.5, 0.5]

    rng = np.random.default_rng(0)
    set_pq_arrays(tiny, _random_arrays(tiny, "global", rng), part="global")
    set_pq_arrays(tiny, _random_arrays(tiny, "local", rng), part="local")
    tiny(IDS, labels=IDS).loss.backward()
    named = list(tiny.named_parameters())
    assert sum(p.requires_grad for _, p in named) == len(trainable) > 0 and len(named) > len(trainable)
    for name, p in named:
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert all(n > 0 for n in block_grad_norms(tiny))


def test_identity_at_init_and_disabled_context(tiny_llama_dir, tiny):
    base = _load(tiny_llama_dir)
    with torch.no_grad():
        ref = base(IDS).logits
        assert torch.equal(tiny(IDS).logits, ref)  # zero P/Q: exactly the base model
        set_pq_arrays(tiny, _random_arrays(tiny, "local", np.random.default_rng(1)), part="local")
        assert not torch.allclose(tiny(IDS).logits, ref)
        with adapters_disabled(tiny):
            assert torch.equal(tiny(IDS).logits, ref)
        assert not torch.allclose(tiny(IDS).logits, ref)


def test_attach_errors(tiny_llama_dir, tiny):
    with pytest.raises(ValueError, match="already"):
        attach_pqlora(tiny, CFG)
    with pytest.raises(ValueError, match="num_blocks"):
        attach_pqlora(_load(tiny_llama_dir), PQLoraConfig(num_blocks=3))
    model = _load(tiny_llama_dir)
    with pytest.raises(ValueError, match="nope_proj"):
        attach_pqlora(model, PQLoraConfig(num_blocks=1, target_modules=("q_proj", "nope_proj")))
    assert not any(isinstance(m, PQLoraLinear) for m in model.modules())  # a bad config leaves the model as is
    with pytest.raises(ValueError, match="r:"):
        attach_pqlora(model, PQLoraConfig(r=64, num_blocks=1))
    assert not any(isinstance(m, PQLoraLinear) for m in model.modules()) and not hasattr(model, "pqlora_gates")


def test_find_decoder_blocks_through_wrappers_and_gpt2_naming(tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.base_model = inner

    assert find_decoder_blocks(Wrapper(tiny)) is tiny.model.layers
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    assert find_decoder_blocks(gpt2) is gpt2.transformer.h
    with pytest.raises(ValueError, match="no transformer blocks"):
        find_decoder_blocks(nn.Sequential(nn.Linear(2, 2)))


# 3. seeded orthonormal A/B -----------------------------------------------------------------------------------


def test_a_b_orthonormal_and_seeded(tiny_llama_dir, tiny):
    other = attach_pqlora(_load(tiny_llama_dir), CFG)
    reseeded = attach_pqlora(_load(tiny_llama_dir), PQLoraConfig(**{**CFG.to_dict(), "seed": 8}))
    layers = lambda m: [x for x in m.modules() if isinstance(x, PQLoraLinear)]  # noqa: E731
    assert len(layers(tiny)) == len(layers(other)) == len(layers(reseeded)) > 0  # zip of empty lists checks nothing
    for a, b, c in zip(layers(tiny), layers(other), layers(reseeded)):
        eye = torch.eye(CFG.r)
        assert torch.allclose(a.A @ a.A.T, eye, atol=1e-5) and torch.allclose(a.B.T @ a.B, eye, atol=1e-5)
        assert a.A.dtype == a.B.dtype == torch.float32
        assert torch.equal(a.A, b.A) and torch.equal(a.B, b.B)
        assert not torch.allclose(a.A, c.A) and not torch.allclose(a.B, c.B)


def test_a_b_identical_in_another_process():
    a, b = seeded_orthonormal(7, 1, "v_proj", 32, 16, 4)
    code = (
        "import sys; sys.path.insert(0, '.'); from common.adapters.pqlora.layer import seeded_orthonormal as s;"
        "a, b = s(7, 1, 'v_proj', 32, 16, 4); print(repr(a.double().sum().item()), repr(b.double().sum().item()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).parents[1]),
    )
    assert out.stdout.split() == [repr(a.double().sum().item()), repr(b.double().sum().item())]


# 4. width-independent names, array I/O, local state -----------------------------------------------------------


def test_names_and_shapes_are_width_independent(tiny):
    wide = attach_pqlora(_wide_qwen(), CFG)
    small, big = get_pq_arrays(tiny), get_pq_arrays(wide)
    assert {k: v.shape for k, v in small.items()} == {k: v.shape for k, v in big.items()}
    assert (
        list(small) == sorted(small)
        and "block0.q_proj.P" in small
        and all(v.dtype == np.float32 for v in small.values())
    )
    assert small  # the loop below must check something
    for prefix in {k.rsplit(".", 1)[0] for k in small}:
        assert small[f"{prefix}.P"].size + small[f"{prefix}.Q"].size == CFG.r * CFG.r + CFG.r
    assert sum(v.size for v in small.values()) == pq_num_floats(CFG)
    # The cross-model property: one model's local P/Q load straight into the other's global buffers.
    trained = _random_arrays(tiny, "local", np.random.default_rng(2))
    set_pq_arrays(tiny, trained, part="local")
    set_pq_arrays(wide, get_pq_arrays(tiny, "local"), part="global")
    assert all(np.array_equal(get_pq_arrays(wide, "global")[k], trained[k]) for k in trained)
    assert set(get_pq_arrays(tiny, blocks=[1])) == {k for k in small if k.startswith("block1.")}


def test_set_arrays_subset_and_errors(tiny):
    arrays = get_pq_arrays(tiny, "global")
    set_pq_arrays(tiny, {"block1.v_proj.Q": np.ones(CFG.r, np.float32)})  # a subset is fine
    assert np.array_equal(get_pq_arrays(tiny, "global")["block1.v_proj.Q"], np.ones(CFG.r))
    with pytest.raises(ValueError, match="block0.q_proj.P"):
        set_pq_arrays(tiny, {"block0.q_proj.P": np.zeros((CFG.r, CFG.r + 1), np.float32)})
    with pytest.raises(KeyError, match="block9.q_proj.P"):
        set_pq_arrays(tiny, {**arrays, "block9.q_proj.P": np.zeros((CFG.r, CFG.r), np.float32)})
    with pytest.raises(ValueError, match="part"):
        get_pq_arrays(tiny, "both")


def test_local_state_swap_and_reset(tiny):
    fresh = get_local_state(tiny)
    assert {"block0.gate", "block1.gate"} <= set(fresh) and fresh["block0.gate"].shape == ()
    rng = np.random.default_rng(3)
    client = {k: (v + rng.standard_normal(v.shape)).astype(np.float32) for k, v in fresh.items()}
    set_local_state(tiny, client)
    assert all(np.array_equal(get_local_state(tiny)[k], client[k]) for k in client)
    assert get_gates(tiny) == pytest.approx([1 / (1 + np.exp(-client[f"block{i}.gate"])) for i in range(2)])
    with pytest.raises(KeyError, match="block1.gate"):
        set_local_state(tiny, {k: v for k, v in client.items() if k != "block1.gate"})
    reset_local_state(tiny)
    assert all(np.array_equal(get_local_state(tiny)[k], fresh[k]) for k in fresh)


# 5. routing: trainable blocks ---------------------------------------------------------------------------------


def test_set_trainable_blocks(tiny):
    set_trainable_blocks(tiny, [1])
    trainable = {n for n, p in tiny.named_parameters() if p.requires_grad}
    assert trainable == {"pqlora_gates.logits.1"} | {
        f"model.layers.1.self_attn.{p}_proj.{w}" for p in "qv" for w in ("P_L", "Q_L")
    }
    tiny(IDS, labels=IDS).loss.backward()
    norms = block_grad_norms(tiny)
    assert norms[0] == 0.0 and norms[1] > 0
    set_trainable_blocks(tiny, None)
    assert sum(p.requires_grad for p in tiny.parameters()) == 2 * 2 * 2 + 2
    with pytest.raises(ValueError, match="active"):
        set_trainable_blocks(tiny, [2])


# 6. save / load -----------------------------------------------------------------------------------------------


def test_save_load_reproduces_logits(tiny_llama_dir, tiny, tmp_path):
    rng = np.random.default_rng(4)
    set_pq_arrays(tiny, _random_arrays(tiny, "local", rng), part="local")
    set_pq_arrays(tiny, _random_arrays(tiny, "global", rng), part="global")
    set_local_state(tiny, {**get_local_state(tiny), "block0.gate": np.float32(1.3), "block1.gate": np.float32(-0.4)})
    out = save_pq_adapter(tiny, CFG, tmp_path / "pq", base_model_name="tiny")
    assert (out / "pqlora_config.json").exists() and (out / "pqlora_model.safetensors").exists()

    reloaded = load_pq_adapter(attach_pqlora(_load(tiny_llama_dir), CFG), out)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, tiny(IDS).logits)
    with pytest.raises(ValueError, match="scaling"):
        load_pq_adapter(attach_pqlora(_load(tiny_llama_dir), PQLoraConfig(**{**CFG.to_dict(), "scaling": 1.0})), out)


def test_config_validation_and_dict_round_trip():
    assert PQLoraConfig.from_dict(CFG.to_dict()) == CFG
    assert PQLoraConfig(target_modules="q_proj, v_proj") == PQLoraConfig()
    for field, bad in [
        ("r", 0),
        ("num_blocks", 0),
        ("target_modules", ()),
        ("scaling", -1.0),
        ("gate_init", float("nan")),
        ("seed", -1),
    ]:
        with pytest.raises(ValueError, match=field):
            PQLoraConfig(**{field: bad})
    with pytest.raises(ValueError, match="alpha"):
        PQLoraConfig.from_dict({"alpha": 2})


# 7. 4-bit base (bitsandbytes on CPU) ---------------------------------------------------------------------------


def test_trains_on_a_4bit_base(tiny_llama_dir):
    import bitsandbytes as bnb

    cfg = PQLoraConfig(**{**CFG.to_dict(), "scaling": 8.0})
    model = attach_pqlora(_load(tiny_llama_dir, "nf4"), cfg)
    q = model.model.layers[1].self_attn.q_proj
    assert isinstance(q, PQLoraLinear) and isinstance(q.base_layer, bnb.nn.Linear4bit)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for _ in range(10):
        loss = model(IDS, labels=IDS).loss
        opt.zero_grad()
        loss.backward()
        if not losses:  # gradients reach block 0 through block 1's 4-bit matmuls
            assert all(n > 0 for n in block_grad_norms(model))
        opt.step()
        losses.append(loss.item())
    # The random tiny Llama's logits are bounded by its small lm_head (loss ~ ln(49152) = 10.8), so the drop is
    # small in absolute terms; it must be steady.
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.05, losses


# 8. alignment -------------------------------------------------------------------------------------------------


def test_procrustes_recovers_a_known_rotation():
    rng = np.random.default_rng(5)
    source = rng.standard_normal((50, 6))
    r_true, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    assert np.allclose(procrustes_rotation(source, source @ r_true), r_true, atol=1e-10)


def test_align_pq_never_worsens_and_maps_onto_the_rotated_frame():
    anchors = synthetic_anchors(4, 32, seed=0)
    assert anchors.shape == (32, 4) and np.array_equal(anchors, synthetic_anchors(4, 32, seed=0))
    rng = np.random.default_rng(6)
    for _ in range(20):
        P, Q, Pr, Qr = (
            rng.standard_normal((4, 4)),
            rng.standard_normal(4),
            rng.standard_normal((4, 4)),
            rng.standard_normal(4),
        )
        P2, Q2, before, after = align_pq(P, Q, Pr, Qr, anchors)
        assert after <= before
        F = anchors @ P.T + Q
        R = procrustes_rotation(F, anchors @ Pr.T + Qr)
        assert np.allclose(anchors @ P2.T + Q2, F @ R)
    # A reference that IS a rotation of the client is recovered exactly.
    r_true, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    _, _, before, after = align_pq(P, Q, r_true.T @ P, r_true.T @ Q, anchors)
    assert before > 0.1 and after < 1e-10


def test_align_zero_reference_is_a_no_op_and_align_arrays():
    rng = np.random.default_rng(7)
    P, Q = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    anchors = synthetic_anchors(4, 16, seed=1)
    P2, Q2, before, after = align_pq(P, Q, np.zeros((4, 4)), np.zeros(4), anchors)
    assert np.array_equal(P2, P) and np.array_equal(Q2, Q) and np.isnan(before) and np.isnan(after)

    arrays = {"block0.q_proj.P": P, "block0.q_proj.Q": Q, "block1.q_proj.P": P, "block1.q_proj.Q": Q}
    reference = {"block0.q_proj.P": P.T.copy(), "block0.q_proj.Q": -Q}
    aligned, errors = align_arrays(arrays, reference, anchors)
    assert set(errors) == {"block0.q_proj"} and errors["block0.q_proj"][1] <= errors["block0.q_proj"][0]
    assert aligned["block1.q_proj.P"] is P and aligned["block0.q_proj.P"].dtype == np.float32
