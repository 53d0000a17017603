"""Per-layer PQ-LoRA math (FedMosaic).

For a frozen projection W_p with input h_I:

    h_O = W_p h_I + scaling * [ (1 - beta) * B (P_L A h_I + Q_L) + beta * B (P_G A h_I + Q_G) ]

(With ``trains_global`` the local path is a personal LoRA inside ``W_p``'s layer, and the PQ path is the global
one alone, trained: h_O = W_p h_I + scaling * beta * B (P A h_I + Q), P/Q held in P_L/Q_L.)

A (r x d_in, orthonormal rows) and B (d_out x r, orthonormal columns) are frozen and drawn from a seed that
depends only on the federation seed, the block index, the projection name and the layer's shape, so every client
with the same base model rebuilds identical A/B without any communication. Only the r x r P and the r-vector Q
depend on training, which makes them width-independent: clients with different base models share P/Q.
"""

from __future__ import annotations

import zlib
from typing import cast

import torch
from torch import nn

from ..wrapping import WrappedProjection


def derive_seed(seed: int, block: int, proj: str, d_in: int, d_out: int) -> int:
    """A 32-bit seed for one layer's A/B; crc32 (not ``hash``) so it is identical in every Python process."""
    return zlib.crc32(f"pqlora|{seed}|{block}|{proj}|{d_in}|{d_out}".encode())


def seeded_orthonormal(
    seed: int, block: int, proj: str, d_in: int, d_out: int, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen (A, B) pair of one layer: QR of seeded Gaussians, float32, A rows and B columns orthonormal."""
    if r > min(d_in, d_out):
        raise ValueError(f"r: rank {r} exceeds min(d_in={d_in}, d_out={d_out}) of {proj} in block {block}")
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, block, proj, d_in, d_out))

    def orthonormal_columns(rows: int) -> torch.Tensor:
        # float64 on the CPU: the result must not depend on the device or on reduced-precision kernels.
        q, rr = torch.linalg.qr(torch.randn(rows, r, generator=gen, dtype=torch.float64))
        # Fix the sign ambiguity of QR so the factor is a function of the Gaussian draw alone.
        signs = torch.sign(torch.diagonal(rr))
        signs[signs == 0] = 1.0
        return (q * signs).to(torch.float32)

    a = orthonormal_columns(d_in).T.contiguous()  # r x d_in
    b = orthonormal_columns(d_out).contiguous()  # d_out x r
    return a, b


class PQLoraGates(nn.Module):
    """Owner of the per-block gate logits (one learnable scalar per adapted block, beta = sigmoid(logit)).

    The gate of a block is shared by all of that block's adapted projections, so it lives here exactly once;
    layers hold an unregistered reference to this container and never register the parameter themselves.
    """

    def __init__(self, num_blocks: int, gate_init: float = 0.0, config=None) -> None:
        super().__init__()
        self.logits = nn.ParameterList(nn.Parameter(torch.tensor(float(gate_init))) for _ in range(num_blocks))
        self.gate_init = float(gate_init)
        self.config = config  # the PQLoraConfig it was built from (plain attribute, not state)

    def beta(self, block: int) -> torch.Tensor:
        """Mixing weight of the global path for ``block``."""
        return torch.sigmoid(self.logits[block])

    def extra_repr(self) -> str:
        return f"num_blocks={len(self.logits)}, gate_init={self.gate_init}"


class PQLoraLinear(WrappedProjection):
    """A frozen projection (``nn.Linear``, bnb ``Linear4bit``...) plus the PQ-LoRA path of one block.

    ``base_layer`` is kept as is; buffers A, B, P_G, Q_G and parameters P_L, Q_L are float32 on the base
    layer's device. ``enabled = False`` returns exactly the base output.
    """

    # Registered with ``register_buffer`` / set with ``object.__setattr__`` in ``__init__``; declared here so their
    # types are known (``nn.Module.__getattr__`` is typed ``Tensor | Module``).
    A: torch.Tensor
    B: torch.Tensor
    P_G: torch.Tensor
    Q_G: torch.Tensor
    _gates: PQLoraGates

    def __init__(
        self,
        base_layer: nn.Module,
        *,
        block: int,
        proj: str,
        r: int,
        scaling: float,
        seed: int,
        gates: PQLoraGates,
        trains_global: bool = False,
    ) -> None:
        super().__init__()
        if not hasattr(base_layer, "in_features") or not hasattr(base_layer, "out_features"):
            raise ValueError(
                f"target_modules: {proj} in block {block} has no in_features/out_features ({type(base_layer).__name__})"
            )
        self.base_layer = base_layer
        # cast: nn.Module attribute access is typed ``Tensor | Module``; checked above, linear-like layers (nn.Linear,
        # bnb Linear4bit) keep in_features/out_features as plain ints.
        self.in_features = int(cast(int, base_layer.in_features))
        self.out_features = int(cast(int, base_layer.out_features))
        self.block, self.proj, self.r, self.scaling = block, proj, r, float(scaling)
        self.enabled = True
        self.trains_global = trains_global
        first = next(base_layer.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")

        a, b = seeded_orthonormal(seed, block, proj, self.in_features, self.out_features, r)
        self.register_buffer("A", a.to(device))
        self.register_buffer("B", b.to(device))
        f32 = torch.float32
        # Zero P/Q: the adapter starts as the identity function of the base model.
        self.P_L = nn.Parameter(torch.zeros(r, r, dtype=f32, device=device))
        self.Q_L = nn.Parameter(torch.zeros(r, dtype=f32, device=device))
        self.register_buffer("P_G", torch.zeros(r, r, dtype=f32, device=device))
        self.register_buffer("Q_G", torch.zeros(r, dtype=f32, device=device))
        # Bypass nn.Module.__setattr__: the shared gate must not be registered (and thus saved) once per layer.
        object.__setattr__(self, "_gates", gates)

    @property
    def name(self) -> str:
        """``block{i}.{proj}``: the prefix of this layer's arrays (independent of the model's depth/width)."""
        return f"block{self.block}.{self.proj}"

    def gate_logit(self) -> nn.Parameter:
        """The (shared) gate logit of this layer's block."""
        return self._gates.logits[self.block]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Base output + ``scaling * B((1-beta)(P_L A x + Q_L) + beta(P_G A x + Q_G))``; just the base if disabled."""
        out = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return out
        # float32 whatever the base computes in (bf16 on CUDA) and even after a stray ``model.to(bf16)``: the
        # adapter is tiny, so its precision is cheap (the casts are no-ops in the normal case).
        f32 = torch.float32
        beta = self._gates.beta(self.block).to(self.A.device, f32)
        # B (.) is linear, so both paths collapse into one r x r map and one r-vector: a single small matmul.
        if self.trains_global:  # one trained PQ path (P_L holds it); the local path is a LoRA inside base_layer
            p, q = beta * self.P_L.to(f32), beta * self.Q_L.to(f32)
        else:
            p = (1.0 - beta) * self.P_L.to(f32) + beta * self.P_G.to(f32)
            q = (1.0 - beta) * self.Q_L.to(f32) + beta * self.Q_G.to(f32)
        u = x.to(f32) @ self.A.to(f32).T
        delta = (u @ p.T + q) @ self.B.to(f32).T
        return out + (self.scaling * delta).to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.name}: in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"scaling={self.scaling}, enabled={self.enabled}"
        )
