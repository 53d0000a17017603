"""The answer tokens' cross-entropy without every answer token's vocabulary-wide logits at once.

``train.loss-chunk-tokens``: the final hidden states at the labelled positions go through the lm_head and the
cross-entropy a chunk of positions at a time. Two ways, the same loss and gradients to float rounding:
- a plain ``nn.Linear`` head (tied embeddings included): :class:`LinearCrossEntropy`, the gradients with respect to
  the hidden states (and to the head's weight and bias where they train) computed chunk by chunk in the forward
  pass, so the backward pass only scales them; nothing is recomputed and at most one chunk's logits exist;
- any other head (a LoRA on the lm_head, a quantised one): each chunk's logits and loss checkpointed, recomputed in
  the backward pass (one more lm_head forward per chunk).
Liger's and Apple's fused kernels (``liger-kernel``, ``cut-cross-entropy`` on PyPI) do the first in Triton on CUDA
only; this one is plain torch, for the CPU and any device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

# Config fields with which a model transforms the lm_head's output before returning it (Gemma's soft-capping,
# Cohere's and Granite's scales): its loss cannot be rebuilt from the lm_head alone, so it is never chunked.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def plain_lm_head(model) -> bool:
    """Whether the model's logits are its output embedding's output as is (what a chunked loss rebuilds)."""
    config = getattr(model, "config", None)
    transformed = any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS)
    return not transformed and model.get_output_embeddings() is not None


@contextmanager
def bypassed(head: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``head`` returning its input while the block runs (so the model's "logits" are the hidden states it would
    project), through an instance attribute, and whatever was there put back (accelerate's hooks live there too)."""
    saved = head.__dict__.get("forward")
    head.__dict__["forward"] = lambda hidden: hidden
    try:
        yield head
    finally:
        if saved is None:
            del head.__dict__["forward"]
        else:
            head.__dict__["forward"] = saved


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, ``chunk`` rows at a time; the
    gradients are computed in the forward pass (softmax minus the one-hot target, times the weight or the hidden
    states), so no row's logits outlive its chunk."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, chunk: int):
        trains_weight, trains_bias = weight.requires_grad, bias is not None and bias.requires_grad
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if trains_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if trains_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows, wanted = hidden[start : start + chunk], targets[start : start + chunk]
            logits = F.linear(rows, weight, bias).float()
            norm = torch.logsumexp(logits, dim=-1)
            total += (norm - logits.gather(1, wanted[:, None])[:, 0]).sum()
            probs = logits.sub_(norm[:, None]).exp_()  # the softmax, in the logits' memory
            probs[torch.arange(len(wanted), device=probs.device), wanted] -= 1.0
            grad_hidden[start : start + chunk] = probs.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight += probs.T @ rows.float()
            if grad_bias is not None:
                grad_bias += probs.sum(dim=0)
        ctx.save_for_backward(grad_hidden)
        ctx.weight_grads = (grad_weight, grad_bias, weight.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, scale):
        (grad_hidden,) = ctx.saved_tensors
        grad_weight, grad_bias, dtype = ctx.weight_grads
        return (
            grad_hidden * scale.to(grad_hidden.dtype),
            None if grad_weight is None else (grad_weight * scale).to(dtype),
            None if grad_bias is None else (grad_bias * scale).to(dtype),
            None,
            None,
        )


def _summed_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def chunked_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int):
    """Summed cross-entropy of ``head(hidden)`` against ``targets``, ``chunk`` rows at a time (module docstring)."""
    if type(head) is torch.nn.Linear:
        return LinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, chunk)
    from torch.utils.checkpoint import checkpoint

    sums = [
        checkpoint(_summed_cross_entropy, head, hidden[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
        for s in range(0, len(targets), chunk)
    ]
    return torch.stack(sums).sum()
