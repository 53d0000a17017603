"""Per-layer math of a pool of LoRA experts with token routing (VEMoE, seed 002).

For a frozen projection W with input x, the experts routed for this client (slots S, |S| = m, its top-m) and its
log responsibilities log r_S:

    y = W x + s * sum_{k in S} alpha_k(x) B_k A_k x,    alpha(x) = softmax(log r_S + u_S(x) / gamma)

u(x) = R x is the layer's router (K_max logits per token; only the routed slots' are used). A_k (r x d_in) and B_k
(d_out x r) are expert k's LoRA pair; B starts at zero, so a new expert is the identity function of the base.
With no slot routed (``ExpertRouting.slots`` empty) or ``enabled = False`` the layer returns exactly the base.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..wrapping import WrappedProjection


def token_mixture(log_r: torch.Tensor, router_logits: torch.Tensor, gamma: float) -> torch.Tensor:
    """alpha (..., m) = softmax(log r + u / gamma) over the last axis: ``log_r`` (m,) the client's log
    responsibilities of its routed experts, ``router_logits`` (..., m) the router's u for every token.

    gamma -> infinity gives every token the domain mixture r (renormalised over the routed experts); a small gamma
    lets the router choose per token.
    """
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if router_logits.shape[-1] != log_r.shape[-1]:
        raise ValueError(f"{router_logits.shape[-1]} router logits per token for {log_r.shape[-1]} experts")
    return torch.softmax(log_r + router_logits / gamma, dim=-1)


class ExpertRouting(nn.Module):
    """The routing every expert layer of one model reads in a forward pass: the routed slots and their log
    responsibilities (plain tensors, not parameters), and the router temperature. One per model."""

    slots: torch.Tensor
    log_r: torch.Tensor

    def __init__(self, gamma: float) -> None:
        super().__init__()
        self.gamma = float(gamma)
        self.register_buffer("slots", torch.zeros(0, dtype=torch.long), persistent=False)
        self.register_buffer("log_r", torch.zeros(0), persistent=False)

    def route(self, slots: list[int], r: list[float]) -> None:
        """Route tokens between ``slots`` with domain responsibilities ``r`` (> 0, renormalised over the slots)."""
        if len(slots) != len(r) or any(not value > 0 for value in r):
            raise ValueError(f"route: {len(slots)} slots with responsibilities {r} (each must be > 0)")
        total = float(sum(r))
        device = self.slots.device
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.log_r = torch.log(torch.tensor([value / total for value in r], dtype=torch.float32, device=device))


class ExpertLinear(WrappedProjection):
    """A frozen projection (``nn.Linear``, bnb ``Linear4bit``, ...) plus K_max LoRA experts and a router.

    Parameters (float32, on the base layer's device): ``lora_A`` (K_max, r, d_in), ``lora_B`` (K_max, d_out, r),
    ``router`` (K_max, d_in), zero-initialised except A (seeded per layer and slot by ``attach_experts``).
    """

    _routing: ExpertRouting

    def __init__(self, base_layer: nn.Module, *, path: str, k_max: int, r: int, scaling: float, routing: ExpertRouting):
        super().__init__()
        if not hasattr(base_layer, "in_features") or not hasattr(base_layer, "out_features"):
            raise ValueError(f"experts.target-modules: {path} has no in_features/out_features")
        self.base_layer = base_layer
        self.in_features = int(cast(int, base_layer.in_features))
        self.out_features = int(cast(int, base_layer.out_features))
        if r > min(self.in_features, self.out_features):
            raise ValueError(f"experts.r: {r} exceeds min(d_in, d_out) of {path}")
        self.path, self.k_max, self.r, self.scaling = path, k_max, r, float(scaling)
        self.enabled = True
        first = next(base_layer.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        f32 = torch.float32
        self.lora_A = nn.Parameter(torch.zeros(k_max, r, self.in_features, dtype=f32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(k_max, self.out_features, r, dtype=f32, device=device))
        self.router = nn.Parameter(torch.zeros(k_max, self.in_features, dtype=f32, device=device))
        object.__setattr__(self, "_routing", routing)  # shared by every layer: not registered once per layer

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.base_layer(x, *args, **kwargs)
        slots = self._routing.slots
        if not self.enabled or slots.numel() == 0:
            return out
        f32 = torch.float32
        h = x.to(f32)
        a, b = self.lora_A[slots], self.lora_B[slots]  # (m, r, d_in), (m, d_out, r)
        u = h @ self.router[slots].T  # (..., m)
        alpha = token_mixture(self._routing.log_r, u, self._routing.gamma)
        z = torch.einsum("...d,mrd->...mr", h, a)
        delta = torch.einsum("...m,...mr,mor->...o", alpha, z, b)
        return out + (self.scaling * delta).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{self.path}: k_max={self.k_max}, r={self.r}, scaling={self.scaling}, enabled={self.enabled}"
