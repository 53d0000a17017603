"""Client-side task fingerprints (seed 003, phase 1): adapter gradients of the last decoder blocks, each layer
L2-normalised, concatenated and count-sketched with a shared seed.

``adapter_gradients`` is the torch part (a backward pass per batch, nothing stepped); the rest are pure functions
(NumPy in, NumPy out).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.adapters.lora.ranks import PEFT_PREFIX
from common.adapters.pqlora.model import find_decoder_blocks
from common.data import Example
from common.training import batch_loss

from ..sketches import count_sketch

EPS = 1e-12


@dataclass
class AdapterGradients:
    """Per adapted layer (peft's module path, ``model.layers.29.self_attn.q_proj``): the flat gradient of its
    adapter parameters (a LoRA layer's A and B together) and its decoder block (None outside the blocks)."""

    gradients: dict[str, np.ndarray]
    block_of: dict[str, int | None]
    batches: int

    def last_blocks(self, count: int) -> list[str]:
        """The layers of the last ``count`` blocks that have adapter layers, plus every layer outside the blocks
        (an adapted output head), sorted."""
        blocks = sorted({b for b in self.block_of.values() if b is not None})
        keep = set(blocks[-count:]) if count > 0 else set()
        return sorted(n for n, b in self.block_of.items() if b is None or b in keep)


def adapter_gradients(model, tokenizer, batches: Iterable[Sequence[Example]], max_len: int) -> AdapterGradients:
    """Gradient of the summed per-batch answer loss with respect to every trainable adapter parameter, grouped per
    adapted layer. Gradients are left cleared; no weight changes."""
    blocks = find_decoder_blocks(model)
    block_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable adapter parameters to fingerprint")
    model.zero_grad(set_to_none=True)
    used = 0
    was_training = model.training
    model.eval()  # no dropout: the fingerprint describes the data, not a random mask
    try:
        for batch in batches:
            if batch:
                batch_loss(model, tokenizer, list(batch), max_len).backward()
                used += 1
    finally:
        model.train(was_training)
    if used == 0:
        raise ValueError("no batches to fingerprint")
    parts: dict[str, list[np.ndarray]] = {}
    layer_block: dict[str, int | None] = {}
    for name, param in named:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        layer = layer_name(name)
        parts.setdefault(layer, []).append(grad.detach().float().cpu().numpy().ravel())
        layer_block[layer] = block_of.get(id(param))
    model.zero_grad(set_to_none=True)
    gradients = {k: np.concatenate(v).astype(np.float32) for k, v in sorted(parts.items())}
    return AdapterGradients(gradients, layer_block, used)


def layer_name(parameter: str) -> str:
    """``base_model.model.model.layers.29.self_attn.q_proj.lora_B.default.weight`` ->
    ``model.layers.29.self_attn.q_proj``: the adapted module's path, as peft's ``rank_pattern`` names it (A and B
    of one LoRA layer fall together)."""
    path = parameter.removeprefix(PEFT_PREFIX).split(".")
    for marker in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        if marker in path:
            return ".".join(path[: path.index(marker)])
    return ".".join(path)


def layer_normalised(gradients: dict[str, np.ndarray], layers: Sequence[str]) -> np.ndarray:
    """The chosen layers' gradients, each divided by its L2 norm (a zero gradient stays zero), concatenated in the
    given order (float64)."""
    parts = []
    for name in layers:
        g = np.asarray(gradients[name], dtype=np.float64)
        norm = float(np.linalg.norm(g))
        parts.append(g / norm if norm > EPS else g)
    return np.concatenate(parts) if parts else np.zeros(0)


def sketch(vector: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """A count sketch of ``vector`` to ``dim`` numbers: coordinate j goes to bucket h(j) with sign s(j), both drawn
    from ``seed`` (shared by every client, so sketches compare coordinate by coordinate; inner products are kept
    in expectation)."""
    x = np.asarray(vector, dtype=np.float64).ravel()
    bucket, sign = count_sketch(x.size, dim, seed)
    out = np.zeros(dim)
    np.add.at(out, bucket, sign * x)
    return out


def layer_norms(gradients: dict[str, np.ndarray]) -> dict[str, float]:
    """The L2 norm of every layer's gradient: ATLAS's layer importance for rank allocation."""
    return {name: float(np.linalg.norm(g)) for name, g in gradients.items()}
