"""4-bit layers train the same on every CPU (``common.bnb_cpu``).

bitsandbytes' packed CPU kernel exists only on CPUs with AVX512-BF16. Tests that need it run in one of two modes:
``native`` (the real kernel; skipped, with the reason, on a CPU without it) and ``emulated`` (on such a CPU only:
a pure-torch implementation of the same packed layout and bf16 math is registered as the CPU kernel, so the
layout switching is exercised on every machine). Exactly one of the two runs anywhere. The gradient test also
runs unparametrised, with whatever this machine does by default.
"""

from __future__ import annotations

import copy

import pytest
import torch

from common import bnb_cpu
from common.bnb_cpu import PackedInferenceLinear4bit, packable, use_packed_inference
from common.model import load_base_model

IDS = torch.tensor([[1, 17, 305, 4021, 77, 12, 9, 2000, 31, 8]])
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def packable_llama_dir(tmp_path_factory):
    """A small random Llama whose projections fit the packed layout (widths multiples of 32 and of 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    out = tmp_path_factory.mktemp("packable-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(params=["native", "emulated"])
def packed_kernel(request):
    """The packed CPU kernel: bitsandbytes' own where the CPU has it, else a registered pure-torch equivalent."""
    native = bnb_cpu.cpu_kernel_available()
    if request.param == "native" and not native:
        pytest.skip(
            "this CPU has no AVX512-BF16, so bitsandbytes has no packed 4-bit kernel here "
            "(the 'emulated' variant covers the switching logic)"
        )
    if request.param == "emulated" and native:
        pytest.skip("this CPU has AVX512-BF16: the 'native' variant runs the real kernel")
    if request.param == "native":
        yield {"n": 0, "native": 1}
    else:
        with bnb_cpu.emulated_packed_kernel() as calls:
            yield calls


def _load(path, packed: bool = True):
    return load_base_model(str(path), "nf4", "cpu", cpu_packed_inference=packed)


def _attach(model, kind: str):
    if kind == "lora":
        from common.adapters import attach_lora
        from common.adapters.lora import LoraSection

        return attach_lora(model, LoraSection(r=4, target_modules=LORA_TARGETS), seed=3)
    from common.adapters.pqlora import PQLoraConfig, attach_pqlora

    return attach_pqlora(
        model, PQLoraConfig(r=4, num_blocks=2, target_modules=("q_proj", "v_proj", "o_proj"), scaling=8.0)
    )


def _infer(model) -> None:
    """What evaluation, generation and signature probes do: eval mode, no grad."""
    model.eval()
    with torch.no_grad():
        model(input_ids=IDS)
        model.generate(
            input_ids=IDS[:, :4],
            attention_mask=torch.ones_like(IDS[:, :4]),
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
        )


def _adapter_grads(model, begin: str) -> dict[str, torch.Tensor]:
    if begin == "train-mode":
        model.train()
    # "eval-with-grad": the model stays in eval mode and its first forward simply runs with grad.
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _check_same_gradients(path, kind: str, begin: str) -> None:
    evaluated = _attach(_load(path), kind)
    _infer(evaluated)
    after = _adapter_grads(evaluated, begin)
    fresh = _adapter_grads(_attach(_load(path), kind), begin)
    assert after.keys() == fresh.keys() and len(after) > 0
    for name, grad in after.items():
        torch.testing.assert_close(grad, fresh[name], msg=lambda m, n=name: f"{n}: {m}")
    assert any(float(g.abs().max()) > 0 for g in after.values())


@pytest.mark.parametrize("kind", ["lora", "pqlora"])
@pytest.mark.parametrize("begin", ["train-mode", "eval-with-grad"])
def test_gradients_after_inference_equal_a_fresh_models(packable_llama_dir, kind, begin):
    """On this machine as it is: adapter gradients do not depend on whether the model evaluated before."""
    _check_same_gradients(packable_llama_dir, kind, begin)


@pytest.mark.parametrize("kind", ["lora", "pqlora"])
def test_gradients_after_packed_inference_equal_a_fresh_models(packable_llama_dir, packed_kernel, kind):
    _check_same_gradients(packable_llama_dir, kind, "train-mode")
    assert packed_kernel["n"] > 0 or "native" in packed_kernel  # the inference really ran packed


def _layers(model) -> list[PackedInferenceLinear4bit]:
    return [m for m in model.modules() if isinstance(m, PackedInferenceLinear4bit)]


def test_inference_runs_packed_and_leaves_the_training_layout_alone(packable_llama_dir, packed_kernel):
    model = _load(packable_llama_dir)
    layers = _layers(model)
    assert layers and all(m.packed_inference and not m.support_avx512bf16_for_cpu for m in layers)
    before = [(m.weight.data.clone(), copy.deepcopy(m.weight.quant_state.as_dict(packed=True))) for m in layers]
    model.eval()
    with torch.no_grad():
        packed_logits = model(input_ids=IDS).logits
    assert all("_packed" in m.__dict__ for m in layers)  # each layer inferred through its packed copy
    for m, (data, state) in zip(layers, before):
        assert torch.equal(m.weight.data, data) and not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
        for key, value in m.weight.quant_state.as_dict(packed=True).items():
            assert torch.equal(value, state[key]) if torch.is_tensor(value) else value == state[key], key
    with torch.no_grad():
        plain_logits = _load(packable_llama_dir, packed=False).eval()(input_ids=IDS).logits
    # bf16 activations in the packed kernel: the same model to bf16 precision, not bit for bit.
    torch.testing.assert_close(packed_logits, plain_logits, rtol=0.05, atol=0.05)
    assert not torch.equal(packed_logits, plain_logits)  # a different kernel really ran


def test_packing_off_keeps_every_forward_on_the_normal_path(packable_llama_dir, packed_kernel):
    model = _load(packable_llama_dir, packed=False).eval()
    with torch.no_grad():
        model(input_ids=IDS)
    assert not any(m.packed_inference or "_packed" in m.__dict__ for m in _layers(model))
    assert packed_kernel["n"] == 0


def test_narrow_layers_stay_on_the_normal_path(tiny_llama_dir, packed_kernel):
    """The tiny unit-test Llama (width 32, quantisation blocks of 64) used to crash bitsandbytes' conversion."""
    model = _load(tiny_llama_dir).eval()
    layers = _layers(model)
    narrow = [m for m in layers if not packable(m)]
    assert narrow and all(not m.packed_inference for m in narrow)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    assert torch.isfinite(logits).all()
    assert not any("_packed" in m.__dict__ for m in narrow)


def test_a_layer_bitsandbytes_packed_in_place_is_converted_back(packable_llama_dir, packed_kernel):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    raw = AutoModelForCausalLM.from_pretrained(str(packable_llama_dir), quantization_config=quant, device_map="cpu")
    for m in raw.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = True  # what bitsandbytes sets by itself on an AVX512-BF16 CPU
    with torch.no_grad():
        raw.eval()(input_ids=IDS)
    weights = [m.weight for m in raw.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert all(w.quant_state.packing_format_for_cpu for w in weights)  # bitsandbytes' in-place conversion
    counts = use_packed_inference(raw)
    assert counts == {"layers": len(weights), "packed": len(weights), "dequantised": 0}
    assert not any(getattr(w.quant_state, "packing_format_for_cpu", False) for w in weights)
    raw.train()
    loss = raw(input_ids=IDS, labels=IDS).loss
    assert torch.isfinite(loss)


def test_without_the_kernel_every_forward_uses_a_dequantised_copy_with_bitsandbytes_numbers(tiny_llama_dir):
    """Layers without the packed kernel (any CPU with packing off; a CPU without AVX512-BF16 always) run every CPU
    forward, training included, as one dense matmul with the weight dequantised once: logits, loss and LoRA gradients
    bit for bit those of bitsandbytes' own 4-bit CPU path (which dequantises on every forward and backward)."""
    from common.adapters import attach_lora
    from common.adapters.lora import LoraSection

    model = attach_lora(_load(tiny_llama_dir, packed=False), LoraSection(r=4, target_modules=LORA_TARGETS), seed=3)
    layers = _layers(model)
    assert layers and all(m.dequantised and not m.packed_inference for m in layers)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)  # lora_B starts at zero: give every LoRA weight a gradient

    def run(dequantised: bool):
        for m in layers:
            m.dequantised = dequantised
        with torch.no_grad():
            logits = model.eval()(input_ids=IDS).logits
        model.train().zero_grad(set_to_none=True)
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return logits, loss.detach(), grads

    bitsandbytes_logits, bitsandbytes_loss, bitsandbytes_grads = run(False)
    assert not any("_dequantised" in m.__dict__ for m in layers)  # the reference never made a copy
    logits, loss, grads = run(True)
    assert all("_dequantised" in m.__dict__ for m in layers)  # each layer really ran on its copy
    assert torch.equal(logits, bitsandbytes_logits) and torch.equal(loss, bitsandbytes_loss)
    assert grads.keys() == bitsandbytes_grads.keys() and any(g.abs().max() > 0 for g in grads.values())
    assert all(torch.equal(grads[n], bitsandbytes_grads[n]) for n in grads)
    assert not any(m.__dict__["_dequantised"][1].requires_grad or m.weight.grad is not None for m in layers)
    for m in layers:
        del m.__dict__["_dequantised"]
    model.train()(input_ids=IDS, labels=IDS).loss.backward()
    assert all("_dequantised" in m.__dict__ for m in layers)  # training forwards use the copy too


def test_packable_shapes():
    import bitsandbytes as bnb

    def quantised(out_features, in_features):
        m = bnb.nn.Linear4bit(in_features, out_features, bias=False, quant_type="nf4")
        m.weight = bnb.nn.Params4bit(
            torch.randn(out_features, in_features), requires_grad=False, quant_type="nf4"
        )._quantize("cpu")
        return m

    assert packable(quantised(64, 128))
    assert not packable(quantised(48, 128))  # rows not in tiles of 32
    assert not packable(quantised(64, 32))  # a row shorter than one quantisation block
    assert not packable(quantised(64, 96))  # a row that ends inside a block
