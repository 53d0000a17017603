"""Random projections from the intrinsic subspace (R^d) into LoRA's parameter space (R^D): theta = theta_0 + P alpha.

Both kinds are linear maps drawn from a seed, so every process that builds one with the same (seed, name, d, D)
holds the same P, and a client only ever sends alpha. Their entries have variance 1/D (each column of P has norm
about 1), so a step on alpha moves theta by about as much whichever kind is used.

- ``dense``: P is a D x d Gaussian matrix in memory: exact and simple, but D x d floats (1.8 GB for SmolLM2's
  q/v LoRA at r = 8 and d = 1,000), so only for small adapters and tests.
- ``fastfood`` (Le, Sarlos & Smola, "Fastfood: approximating kernel expansions in loglinear time", ICML 2013): per
  block of n = 2^ceil(log2 d) rows, V = H G Pi H B with H the Walsh-Hadamard transform, B random signs, Pi a random
  permutation and G Gaussian; ceil(D / n) independent blocks are stacked. It holds O(D) numbers and computes P alpha
  in O(D log d). It is the projection Li et al. ("Measuring the intrinsic dimension of objective landscapes", ICLR
  2018) and Aghajanyan et al. ("Intrinsic dimensionality explains the effectiveness of language model
  fine-tuning", ACL 2021) used for networks of millions to billions of parameters, and SubLoRA's own code offers it.
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
from torch import nn

KINDS = ("fastfood", "dense")


def generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator from (seed, name) by crc32: the same stream in every process, independent per name."""
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"sublora|{seed}|{name}".encode()))


@functools.lru_cache(maxsize=64)
def sylvester(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The n x n Sylvester-Hadamard matrix (entries +-1, symmetric): the Kronecker power of [[1, 1], [1, -1]]."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.kron(base, h)
    return h


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform over the last axis (a power of two), differentiable.

    H_n = H_a (x) H_b for n = a b (Sylvester matrices are Kronecker powers), and (H_a (x) H_b) vec(X) = vec(H_a X H_b)
    for X the row-major a x b view of x: two small matrix products, O(n sqrt n), instead of log2 n rounds of
    add/subtract: a handful of kernels whatever n is (the butterfly's many tiny ops were part of why a SubLoRA step
    took twice as long as LoRA's on an H200; ``bench/sublora_subspace_bench.py`` times it).
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: length {n} is not a power of two")
    a = 1 << ((n.bit_length() - 1) // 2)
    h_a, h_b = sylvester(a, x.dtype, x.device), sylvester(n // a, x.dtype, x.device)
    return (h_a @ x.reshape(*x.shape[:-1], a, n // a) @ h_b).reshape(x.shape) / math.sqrt(n)


class Projection(nn.Module):
    """A fixed linear map R^d -> R^D (no trainable parameters): ``forward(alpha)`` is P alpha."""

    def __init__(self, d: int, out: int) -> None:
        super().__init__()
        if d < 1 or out < 1:
            raise ValueError(f"projection: dimensions must be >= 1, got d={d}, D={out}")
        self.d, self.out = d, out

    def matrix(self) -> torch.Tensor:
        """P as a dense D x d matrix (for tests and small sizes)."""
        with torch.no_grad():
            return torch.stack([self(column) for column in torch.eye(self.d)], dim=1)


class DenseProjection(Projection):
    """P with i.i.d. N(0, 1/D) entries, held in memory."""

    weight: torch.Tensor

    def __init__(self, d: int, out: int, seed: int, name: str) -> None:
        super().__init__(d, out)
        matrix = torch.randn(out, d, generator=generator(seed, name)) / math.sqrt(out)
        self.register_buffer("weight", matrix, persistent=False)

    def forward(self, alpha: torch.Tensor) -> torch.Tensor:
        return self.weight @ alpha


class FastfoodProjection(Projection):
    """P stacked from ceil(D / n) Fastfood blocks H G Pi H B (n = 2^ceil(log2 d)), scaled to entries of variance
    1/D; alpha is zero-padded to n."""

    signs: torch.Tensor
    perm: torch.Tensor
    gauss: torch.Tensor

    def __init__(self, d: int, out: int, seed: int, name: str) -> None:
        super().__init__(d, out)
        self.n = 1 << max(0, math.ceil(math.log2(d)))
        blocks = math.ceil(out / self.n)
        gen = generator(seed, name)
        signs = torch.randint(0, 2, (blocks, self.n), generator=gen).float() * 2 - 1
        perm = torch.stack([torch.randperm(self.n, generator=gen) for _ in range(blocks)])
        gauss = torch.randn(blocks, self.n, generator=gen)
        # Each block is orthogonal when |G| = 1; dividing G by its RMS makes E[V^T V] = I, so a column of one block
        # has norm ~1 and one of the D kept rows of the stack has norm ~sqrt(D / n): hence the last factor.
        gauss = gauss / gauss.pow(2).mean(dim=1, keepdim=True).sqrt() / math.sqrt(out / self.n)
        self.register_buffer("signs", signs, persistent=False)
        self.register_buffer("perm", perm, persistent=False)
        self.register_buffer("gauss", gauss, persistent=False)

    def forward(self, alpha: torch.Tensor) -> torch.Tensor:
        x = nn.functional.pad(alpha, (0, self.n - self.d)) * self.signs  # (blocks, n)
        x = hadamard(x)
        x = torch.gather(x, 1, self.perm) * self.gauss
        return hadamard(x).reshape(-1)[: self.out]


def make_projection(kind: str, d: int, out: int, seed: int, name: str) -> Projection:
    """The projection ``kind`` (``fastfood`` or ``dense``) from R^d to R^out, drawn from (seed, name)."""
    if kind == "dense":
        return DenseProjection(d, out, seed, name)
    if kind == "fastfood":
        return FastfoodProjection(d, out, seed, name)
    raise ValueError(f"sublora.projection: '{kind}' is not one of {KINDS}")
