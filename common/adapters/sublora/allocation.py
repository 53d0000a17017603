"""How the d subspace coordinates are shared between LoRA's A and B matrices (seed 004's allocation modes).

- ``uniform``: one projection of all d coordinates onto the concatenated A and B parameters (SubLoRA as published).
- ``fixed``: ``allocation-ratio`` = d_B / d: the first d_A = d - d_B coordinates feed a projection onto every A, the
  last d_B one onto every B.
- ``learned``: each transformer block l gets its own d_l coordinates (d split as evenly as the blocks allow) and a
  gate gamma_l = sigmoid(theta_split_l); the soft mask m_i = sigmoid(C (gamma_l d_l - i)), C = 10 (the seed's
  steepness), sends alpha_i m_i to the block's B projection and alpha_i (1 - m_i) to its A projection, so the split
  point gamma_l d_l is differentiable and trains with alpha. gamma_l = 0.5 at the start.

Pure functions of tensors: the subspace (``layer.Subspace``) applies them.
"""

from __future__ import annotations

import torch

MODES = ("uniform", "fixed", "learned")
STEEPNESS = 10.0  # C of the soft mask (seed 004)


def fixed_dims(d: int, ratio: float) -> tuple[int, int]:
    """(d_A, d_B) for ``fixed`` mode: d_B = round(ratio d), each part at least one coordinate."""
    if d < 2:
        raise ValueError(f"sublora.intrinsic-dim: fixed allocation needs d >= 2, got {d}")
    d_b = min(max(round(ratio * d), 1), d - 1)
    return d - d_b, d_b


def block_dims(d: int, blocks: int) -> list[int]:
    """``learned`` mode: d split over the blocks as evenly as possible (the first ``d % blocks`` get one more)."""
    if d < blocks:
        raise ValueError(f"sublora.intrinsic-dim: learned allocation needs d >= the {blocks} blocks, got {d}")
    return [d // blocks + (1 if i < d % blocks else 0) for i in range(blocks)]


def soft_mask(gate_logit: torch.Tensor, d: int, steepness: float = STEEPNESS) -> torch.Tensor:
    """m (d,) = sigmoid(C (sigmoid(gate_logit) d - i)): ~1 for the first gamma d coordinates (B's), ~0 after."""
    index = torch.arange(d, dtype=gate_logit.dtype, device=gate_logit.device)
    return torch.sigmoid(steepness * (torch.sigmoid(gate_logit) * d - index))


def split_learned(alpha: torch.Tensor, gate_logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha_A, alpha_B) of one block in ``learned`` mode: alpha (1 - m) and alpha m."""
    mask = soft_mask(gate_logit, alpha.shape[-1])
    return alpha * (1 - mask), alpha * mask
