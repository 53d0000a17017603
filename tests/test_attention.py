"""common.attention: packed rows attend per example (each at its own length); every other call is plain SDPA."""

from __future__ import annotations

import pytest
import torch

from common.adapters import attach_lora
from common.adapters.lora import LoraSection
from common.attention import SEGMENT_SDPA, segment_sdpa
from common.data import Example
from common.model import load_base_model, load_tokenizer
from common.training import collate, encode, pack, to_device


class _Attention(torch.nn.Module):
    num_key_value_groups = 2  # 4 query heads over 2 key/value heads, as Llama's grouped-query attention
    is_causal = True


def test_each_example_of_a_packed_row_attends_to_itself_only():
    """The per-example SDPA equals SDPA over the whole row with the block-diagonal causal mask (what transformers
    builds for a packed row), with grouped-query heads."""
    torch.manual_seed(0)
    lengths = [3, 7, 1, 5]
    total = sum(lengths)
    query = torch.randn(1, 4, total, 8)
    key, value = torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    bounds = torch.tensor([0, 3, 10, 11, 16], dtype=torch.int32)
    out, _ = segment_sdpa(_Attention(), query, key, value, None, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
    example = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    block = causal & (example[:, None] == example[None, :])
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=block
    ).transpose(1, 2)
    assert out.shape == (1, total, 4, 8)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    whole = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), is_causal=True
    ).transpose(1, 2)
    assert not torch.allclose(out, whole, atol=1e-3)  # attending across the examples would differ
    with pytest.raises(ValueError, match="does not cover"):
        segment_sdpa(_Attention(), query, key, value, None, cu_seq_lens_q=bounds[:-1])


def test_the_base_model_attends_per_example_when_packed_and_as_sdpa_otherwise(tiny_llama_dir, monkeypatch):
    """The loader switches the model to the segment attention; a padded batch's logits are SDPA's bit for bit, a
    packed row's logits are the padded batch's (to float rounding), and the packed row went through the per-example
    path in every layer."""
    import common.attention as attention

    model = attach_lora(load_base_model(str(tiny_llama_dir), quantization="fp32", device="cpu"), LoraSection(r=4))
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert model.config._attn_implementation == SEGMENT_SDPA
    examples = [Example("toy", "Add: " + " plus ".join(["7"] * k) + "?", str(7 * k)) for k in (1, 9, 3)]
    batch = [encode(tokenizer, e, 128) for e in examples]
    padded = {k: v for k, v in collate(batch, tokenizer.pad_token_id).items() if k != "labels"}
    packed = {k: v for k, v in pack(batch).items() if k != "labels"}
    calls = {"segments": 0}
    real = attention.sdpa_attention_forward

    def counted(module, query, key, value, mask, *args, **kwargs):
        calls["segments"] += kwargs.get("is_causal") is True and mask is None
        return real(module, query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted)
    with torch.no_grad():
        ours_padded = model(**padded).logits
        assert calls["segments"] == 0
        ours_packed = model(**packed).logits[0]
        layers = model.config.num_hidden_layers
        assert calls["segments"] == layers * len(batch)
        model.base_model.model.set_attn_implementation("sdpa")
        sdpa_padded = model(**padded).logits
    assert torch.equal(ours_padded, sdpa_padded)
    start = 0
    for row, e in enumerate(batch):
        n = len(e.input_ids)
        torch.testing.assert_close(ours_packed[start : start + n], ours_padded[row, :n], rtol=1e-5, atol=1e-5)
        start += n


def test_a_packed_batch_on_a_device_keeps_its_bounds_on_the_host(tiny_llama_dir):
    """segment_sdpa reads a packed row's bounds as integers in every layer: on a GPU, a device copy of them would
    wait for the device in each layer, so ``to_device`` moves everything but them ('meta' stands in for a GPU)."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    batch = pack([encode(tokenizer, Example("toy", question, "1"), 64) for question in ("One?", "Two?")])
    moved = to_device(batch, "meta")
    assert moved.keys() == batch.keys() and moved["cu_seq_lens_q"].device.type == "cpu"
    assert all(v.device.type == "meta" for k, v in moved.items() if k != "cu_seq_lens_q")
