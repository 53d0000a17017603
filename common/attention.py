"""Attention for padding-free batches that costs each example its own length, not the row's.

A packed row (``train.packing``: ``common.training.pack``) holds a batch's examples end to end. transformers' SDPA
path keeps attention inside each example by building a block-diagonal mask over the WHOLE row, so the attention costs
(sum of lengths)^2 instead of the sum of squares: on a CPU at batch 8 that cost more than the padding it saved.
``segment_sdpa`` runs PyTorch's SDPA once per example of the row instead (causal, no mask), from the row's example
bounds in ``cu_seq_lens_q``, which ``pack`` supplies: the keyword transformers passes down to the attention function
(flash attention's variable-length kernel reads it too, with ``max_length_q`` and the ``_k`` pair). Any other call
(padded batches, generation with a cache) is plain SDPA with transformers' own mask, so a model switched to it
computes exactly what ``sdpa`` computes there.

``use_segment_attention(model)`` switches a loaded model whose attention is ``sdpa``; the base model loader does it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENT_SDPA = "tessera_segment_sdpa"


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (query/key/value (batch, heads, length, head dim); returns
    (batch, length, heads, head dim)). With ``cu_seq_lens_q`` (example bounds [0, l1, l1 + l2, ..., L]) on a
    one-row batch without a cache, each example attends causally to itself only; otherwise plain SDPA."""
    bounds = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    # A sliding window (Qwen2, Mistral) lives in transformers' mask: such a row keeps it.
    if bounds is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] or kwargs.get("sliding_window"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    edges = [int(edge) for edge in bounds.tolist()]
    if edges[0] != 0 or edges[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q {edges} does not cover the packed row of {query.shape[2]} tokens")
    pieces = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, dropout, scaling, is_causal=True
        )[0]
        for a, b in zip(edges[:-1], edges[1:])
    ]
    return torch.cat(pieces, dim=1), None


AttentionInterface.register(SEGMENT_SDPA, segment_sdpa)
# Masks as for SDPA, so that every call that is not a packed row gets exactly what SDPA gets.
AttentionMaskInterface.register(SEGMENT_SDPA, sdpa_mask)


def use_segment_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a transformers model) from SDPA to :func:`segment_sdpa`; False (unchanged) if its
    attention is something else (eager, flash attention, which handle packed rows their own way)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(SEGMENT_SDPA)  # type: ignore[operator]
    return True


def attends_within_examples(model: torch.nn.Module) -> bool:
    """Whether a packed row's examples attend each to itself only in a forward that fills a key/value cache:
    :func:`segment_sdpa` without a sliding window does. transformers builds its own packed-row mask only without a
    cache, so any other attention would let such a row's examples attend to each other."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != SEGMENT_SDPA:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not getattr(text, "sliding_window", None)
