"""SubLoRA (seed 004) on the tiny Llama: the projection is linear, deterministic from its seed in any
process and scaled like a dense Gaussian one; the allocation modes route alpha as the seed says; the adapter starts
as the base model, trains through alpha (and learned gates) on a 4-bit base, averages alpha as theta, and exports a
PEFT adapter that reproduces its logits; the coding of alpha round-trips and the bound follows its formulas."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.adapters import adapter_kind
from common.adapters.sublora import (
    FastfoodProjection,
    SubLoraSection,
    attach_sublora,
    bound,
    detach_sublora,
    get_arrays,
    make_projection,
    materialise,
    set_arrays,
    sublora_disabled,
)
from common.adapters.sublora.allocation import fixed_dims, soft_mask
from common.adapters.sublora.model import subspace_of, trainable
from common.adapters.sublora.projection import hadamard
from common.config import ConfigError
from common.data import Example
from common.model import load_base_model, load_tokenizer
from common.training import train_round
from strategies import load_run_config

IDS = torch.tensor([[1, 5, 9, 200, 31, 7, 42, 3], [8, 6, 4, 2, 10, 12, 14, 16]])
EXAMPLES = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(8)]


def _load(tiny_llama_dir, quantization="fp32"):
    return load_base_model(str(tiny_llama_dir), quantization=quantization, device="cpu")


def _section(**kw) -> SubLoraSection:
    return SubLoraSection(**{"intrinsic_dim": 64, "r": 2, **kw})


def _random_alpha(model, seed=0, scale=0.5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(v.shape) * scale).astype(np.float32) for k, v in get_arrays(model).items()}


# --- the projection ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 16, 128])
def test_hadamard_is_the_orthonormal_walsh_hadamard_matrix(n):
    # Walsh-Hadamard by its definition, H[i, j] = (-1)^popcount(i & j) / sqrt(n), independent of the factorisation
    index = torch.arange(n)
    parity = torch.tensor([[bin(i & j).count("1") % 2 for j in index.tolist()] for i in index.tolist()])
    expected = (1 - 2 * parity).double() / n**0.5
    batch = torch.randn(3, 2, n, dtype=torch.float64)
    assert torch.allclose(hadamard(torch.eye(n, dtype=torch.float64)), expected, atol=1e-12)
    assert torch.allclose(hadamard(batch), batch @ expected, atol=1e-12)  # over the last axis of any batch


def test_hadamard_refuses_a_length_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.ones(12))


@pytest.mark.parametrize("kind", ["fastfood", "dense"])
def test_the_projection_is_linear_with_unit_columns_on_average(kind):
    p = make_projection(kind, 50, 3000, seed=1, name="x")
    a, b = torch.randn(50, dtype=torch.float64).float(), torch.randn(50).float()
    assert torch.allclose(p(a + 2 * b), p(a) + 2 * p(b), atol=1e-5)
    columns = p.matrix().norm(dim=0)
    assert abs(float(columns.mean()) - 1.0) < 0.1  # each alpha coordinate moves theta by a unit-norm direction
    assert torch.linalg.matrix_rank(p.matrix()) == 50  # d independent directions


def test_fastfood_needs_memory_linear_in_d_plus_big_d_not_their_product():
    p = FastfoodProjection(1000, 460_800, seed=0, name="big")
    held = sum(buf.numel() for buf in p.buffers())
    assert held < 4 * 460_800  # signs, permutation and Gaussian per block: O(D), where a dense P is D x d
    assert p(torch.ones(1000)).shape == (460_800,)


def test_the_projection_is_the_same_in_another_process():
    code = (
        "import torch; from common.adapters.sublora import make_projection;"
        "p = make_projection('fastfood', 37, 999, seed=5, name='A'); x = torch.linspace(-1, 1, 37);"
        "print(repr(p(x).double().sum().item()), repr(p(x).double().pow(2).sum().item()))"
    )
    here = make_projection("fastfood", 37, 999, seed=5, name="A")(torch.linspace(-1, 1, 37)).double()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert (float(out[0]), float(out[1])) == (here.sum().item(), here.pow(2).sum().item())
    other = make_projection("fastfood", 37, 999, seed=6, name="A")(torch.linspace(-1, 1, 37))
    assert not torch.allclose(other, here.float())  # another seed, another subspace


# --- the allocation modes ---------------------------------------------------------------------------------------


def _moved(model, alpha: np.ndarray) -> tuple[float, float]:
    """(|change of every A|, |change of every B|) when alpha moves from 0 to ``alpha``."""
    set_arrays(model, {**get_arrays(model), "alpha": np.zeros_like(alpha)})
    before = materialise(model)
    set_arrays(model, {**get_arrays(model), "alpha": alpha})
    after = materialise(model)
    parts = [sum(float(np.abs(after[k] - before[k]).sum()) for k in after if f"lora_{p}" in k) for p in "AB"]
    return parts[0], parts[1]


def test_fixed_half_sends_the_first_half_of_alpha_to_a_and_the_rest_to_b_while_uniform_mixes_both(tiny_llama_dir):
    assert fixed_dims(64, 0.5) == (32, 32) and fixed_dims(64, 0.25) == (48, 16)
    fixed = attach_sublora(_load(tiny_llama_dir), _section(allocation="fixed", allocation_ratio=0.5))
    first, last = np.zeros(64, np.float32), np.zeros(64, np.float32)
    first[:32], last[32:] = 1.0, 1.0
    a_moved, b_moved = _moved(fixed, first)
    assert a_moved > 0 and b_moved == 0
    a_moved, b_moved = _moved(fixed, last)
    assert a_moved == 0 and b_moved > 0
    uniform = attach_sublora(_load(tiny_llama_dir), _section(allocation="uniform"))
    for alpha in (first, last):
        a_moved, b_moved = _moved(uniform, alpha)
        assert a_moved > 0 and b_moved > 0  # one projection onto A and B together


def test_the_learned_soft_mask_splits_at_gamma_d():
    mask = soft_mask(torch.tensor(0.0), 20)  # gamma = 0.5: the first 10 coordinates to B
    assert torch.all(mask[:9] > 0.99) and torch.all(mask[11:] < 0.01)
    assert torch.all(soft_mask(torch.tensor(3.0), 20)[:18] > 0.99)  # gamma = 0.95


def test_the_gates_step_at_their_own_rate_when_given_one(tiny_llama_dir):
    """sublora.gate-learning-rate: the gates get a parameter group of their own (AdamW's step is about the rate,
    so at 100x alpha's rate they move far more); 0 keeps one group, and only the learned mode has gates."""
    moved = {}
    for gate_lr in (0.0, 3.0):
        cfg = load_run_config(
            {"strategy": "local", "local.adapter": "sublora", "sublora.intrinsic-dim": 64, "sublora.r": 2,
             "sublora.allocation": "learned", "sublora.gate-learning-rate": gate_lr, "train.local-steps": 4}
        )  # fmt: skip
        adapter = adapter_kind("sublora")(_load(tiny_llama_dir), cfg)
        adapter.begin(None, _random_alpha(adapter.model, scale=0.1))  # type: ignore[arg-type]
        adapter.prepare_training()
        groups = adapter.lr_groups()
        gates = subspace_of(adapter.model).gates
        assert gates is not None
        if gate_lr:
            assert groups is not None and [scale for _, scale in groups] == [1.0, gate_lr / 0.03]
        else:
            assert groups is None
        before = gates.detach().clone()
        settings = cfg.train_settings()
        tokenizer = load_tokenizer(str(tiny_llama_dir))
        train_round(adapter.model, tokenizer, EXAMPLES, settings, settings.learning_rate, seed=0, lr_groups=groups)
        moved[gate_lr] = float((gates.detach() - before).abs().max())
    assert moved[3.0] > 10 * moved[0.0] > 0, moved
    uniform = load_run_config({"strategy": "local", "local.adapter": "sublora", "sublora.gate-learning-rate": 3.0})
    assert adapter_kind("sublora")(_load(tiny_llama_dir), uniform).lr_groups() is None  # no gates to step


def test_learned_gates_and_alpha_receive_gradients_and_training_lowers_the_loss_on_4bit(tiny_llama_dir):
    cfg = load_run_config(
        {"strategy": "local", "local.adapter": "sublora", "sublora.intrinsic-dim": 64, "sublora.r": 2,
         "sublora.allocation": "learned", "train.local-steps": 30, "train.batch-size": 4}
    )  # fmt: skip
    adapter = adapter_kind("sublora")(_load(tiny_llama_dir, "nf4"), cfg)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    adapter.begin(None, adapter.initial)  # type: ignore[arg-type]  # SubLoRA reads no state
    adapter.prepare_training()
    subspace = subspace_of(adapter.model)
    assert subspace.gates is not None and subspace.gates.shape == (2,)  # one gate per block
    from common.training import batch_loss

    adapter.begin(None, _random_alpha(adapter.model, scale=0.1))  # type: ignore[arg-type]
    # At alpha = 0 a gate has no gradient (it only moves the split of alpha): from a nonzero alpha it has one.
    batch_loss(adapter.model, tokenizer, EXAMPLES[:4], 128).backward()
    assert subspace.alpha.grad is not None and float(subspace.alpha.grad.abs().sum()) > 0
    assert subspace.gates.grad is not None and float(subspace.gates.grad.abs().sum()) > 0
    adapter.model.zero_grad(set_to_none=True)
    adapter.begin(None, adapter.initial)  # type: ignore[arg-type]
    settings = cfg.train_settings()
    with torch.no_grad():
        before = float(batch_loss(adapter.model, tokenizer, EXAMPLES, 128))
    train_round(adapter.model, tokenizer, EXAMPLES, settings, settings.learning_rate, seed=0)
    with torch.no_grad():
        after = float(batch_loss(adapter.model, tokenizer, EXAMPLES, 128))
    sent, _ = adapter.outgoing()
    assert sorted(sent) == ["alpha", "gates"] and sent["alpha"].shape == (64,)
    assert after < before - 0.1, (before, after)


# --- the adapter ------------------------------------------------------------------------------------------------


def test_attached_sublora_is_the_base_model_until_alpha_moves_and_when_disabled(tiny_llama_dir):
    base_logits = _load(tiny_llama_dir)(IDS).logits
    model = attach_sublora(_load(tiny_llama_dir), _section())
    assert torch.equal(model(IDS).logits, base_logits)  # theta_0 has B = 0
    set_arrays(model, _random_alpha(model))
    assert not torch.allclose(model(IDS).logits, base_logits)
    with sublora_disabled(model):
        assert torch.equal(model(IDS).logits, base_logits)
    detach_sublora(model)
    assert torch.equal(model(IDS).logits, base_logits)
    assert not hasattr(model, "sublora_subspace")


@pytest.mark.parametrize("allocation", ["uniform", "fixed", "learned"])
def test_averaging_alpha_is_averaging_theta(tiny_llama_dir, allocation):
    model = attach_sublora(_load(tiny_llama_dir), _section(allocation=allocation))
    clients = [_random_alpha(model, seed=s) for s in range(3)]
    if allocation == "learned":  # the map is linear in alpha for given gates
        for arrays in clients:
            arrays["gates"] = clients[0]["gates"]
    thetas = []
    for arrays in clients:
        set_arrays(model, arrays)
        thetas.append(materialise(model))
    set_arrays(model, {k: np.mean([c[k] for c in clients], axis=0) for k in clients[0]})
    averaged = materialise(model)
    for key in averaged:
        np.testing.assert_allclose(averaged[key], np.mean([t[key] for t in thetas], axis=0), atol=1e-5)


def test_the_exported_peft_adapter_reproduces_the_logits(tiny_llama_dir, tmp_path):
    from peft import PeftModel

    from common.adapters.sublora.model import save_materialised

    section = _section(allocation="fixed")
    model = attach_sublora(_load(tiny_llama_dir), section)
    set_arrays(model, _random_alpha(model))
    with torch.no_grad():
        ours = model(IDS).logits
    out = save_materialised(model, section, str(tiny_llama_dir), tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_load(tiny_llama_dir), str(out))
    with torch.no_grad():
        theirs = loaded(IDS).logits
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert set(np.load(out / "subspace.npz").files) == {"alpha"}


def test_bad_arrays_and_configs_name_what_is_wrong(tiny_llama_dir):
    model = attach_sublora(_load(tiny_llama_dir), _section())
    with pytest.raises(ValueError, match="alpha: shape"):
        set_arrays(model, {"alpha": np.zeros(3, np.float32)})
    with pytest.raises(KeyError, match="gates"):
        set_arrays(model, {"alpha": np.zeros(64, np.float32), "gates": np.zeros(2, np.float32)})
    with pytest.raises(ConfigError, match="sublora.allocation"):
        load_run_config({"strategy": "local", "local.adapter": "sublora", "sublora.allocation": "random"})
    with pytest.raises(ValueError, match="sublora.projection: 'dense' would hold"):
        attach_sublora(_load(tiny_llama_dir), _section(projection="dense", intrinsic_dim=1_000_000))
    assert trainable(model)[0] is subspace_of(model).alpha


# --- the code and the bound -------------------------------------------------------------------------------------


def test_quantised_alpha_codes_and_decodes_exactly_and_shorter_than_raw():
    rng = np.random.default_rng(0)
    alpha = rng.standard_normal(2000).astype(np.float32)
    codebook, indices = bound.quantise(alpha, 16)
    assert len(codebook) == 16 and np.all(np.diff(codebook) > 0)
    nearest = np.abs(alpha[:, None] - codebook[None, :]).argmin(axis=1)
    assert np.array_equal(indices, nearest)  # every number goes to its nearest level
    words, counts = bound.encode(indices, len(codebook))
    assert np.array_equal(bound.decode(words, counts), indices)
    bits = bound.code_length(len(indices), len(codebook), words)
    entropy = -sum(c * math.log2(c / len(indices)) for c in counts if c)
    assert entropy <= 32 * len(words) <= entropy + 64  # the range coder is within a few words of the entropy
    assert bits < 32 * 2000 / 6  # 16 levels: under 4 bits a number, against 32 raw


def test_the_bound_follows_its_formulas():
    per_example = [(2.0 * n, n // 4, n) for n in (4, 8, 12, 16)]  # 2 bits and 1/4 errors per token
    result = bound.bounds(1000, per_example, vocab=1024, smoothing=0.1, delta=0.05)
    assert result.train_bits_per_token == pytest.approx(2.0) and result.train_top1_error == pytest.approx(0.25)
    gap = math.log2(1024 / 0.1) * math.sqrt((1000 * math.log(2) + math.log(2 / 0.05)) / 8)
    assert result.bits_per_token == pytest.approx(2.0 + gap)
    c = (1000 * math.log(2) + math.log(4 * math.sqrt(4) / 0.05)) / 4
    assert bound.binary_kl(0.25, result.top1_error) == pytest.approx(c, rel=1e-6) or result.top1_error == 1.0
    more = bound.bounds(1000, per_example * 1000, vocab=1024, smoothing=0.1, delta=0.05)
    assert more.bits_per_token < result.bits_per_token and more.top1_error < 1.0  # more data, tighter bound
    assert bound.kl_inverse(0.1, 0.05) > 0.1 and bound.binary_kl(0.1, bound.kl_inverse(0.1, 0.05)) == pytest.approx(
        0.05
    )
