"""Per-layer math of SubLoRA: a LoRA layer whose A and B are read from the model's subspace at every forward.

For a frozen projection W (an ``nn.Linear`` or a bitsandbytes ``Linear4bit``) with input x:

    y = W x + s B A x,    (A, B) of every layer = theta_0 + P alpha, split by the allocation mode

``Subspace`` holds what trains (alpha, and the per-block gates in ``learned`` mode), theta_0 (A drawn from the seed
like peft's kaiming-uniform init, B = 0, so the adapter starts as the base model) and the projections; it computes
every layer's (A, B) once per forward of the model (``refresh``, called by a forward pre-hook) and each layer reads
its own pair.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..wrapping import WrappedProjection
from .allocation import block_dims, fixed_dims, split_learned
from .projection import Projection, make_projection


@dataclass(frozen=True)
class LayerShape:
    """One adapted projection: its module path, transformer block, and LoRA shapes A (r, d_in), B (d_out, r)."""

    path: str
    block: int
    r: int
    d_in: int
    d_out: int

    @property
    def size(self) -> int:
        return self.r * (self.d_in + self.d_out)


def initial_a(seed: int, path: str, r: int, d_in: int) -> torch.Tensor:
    """theta_0's A of one layer: uniform in +-1/sqrt(d_in) (peft's kaiming-uniform bound), from a crc32 seed."""
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"sublora|{seed}|{path}".encode()))
    return (torch.rand(r, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)


class Subspace(nn.Module):
    """alpha (d,) and, in ``learned`` mode, one gate logit per block; theta_0 and the projections P (not trained).

    Projection groups (each one projection from a slice of alpha onto a list of (layer, part) targets):
    uniform: alpha -> every A and B; fixed: alpha[:d_A] -> every A, alpha[d_A:] -> every B; learned: per block,
    its slice split by the soft mask -> that block's A's and B's.
    """

    def __init__(
        self, layers: list[LayerShape], d: int, allocation: str, ratio: float, projection: str, seed: int
    ) -> None:
        super().__init__()
        self.layers, self.d, self.allocation = layers, d, allocation
        self.alpha = nn.Parameter(torch.zeros(d))
        blocks = sorted({layer.block for layer in layers})
        self.blocks = blocks
        self.gates = nn.Parameter(torch.zeros(len(blocks))) if allocation == "learned" else None
        for i, layer in enumerate(layers):
            self.register_buffer(f"a0_{i}", initial_a(seed, layer.path, layer.r, layer.d_in), persistent=False)
        # (alpha slice start, stop, block position for a learned split or -1, part "A"/"B"/"AB", layer indices)
        self.groups: list[tuple[int, int, int, str, list[int]]] = []
        everything = list(range(len(layers)))
        if allocation == "uniform":
            self.groups.append((0, d, -1, "AB", everything))
        elif allocation == "fixed":
            d_a, _ = fixed_dims(d, ratio)
            self.groups += [(0, d_a, -1, "A", everything), (d_a, d, -1, "B", everything)]
        elif allocation == "learned":
            start = 0
            for position, (block, d_l) in enumerate(zip(blocks, block_dims(d, len(blocks)))):
                members = [i for i, layer in enumerate(layers) if layer.block == block]
                self.groups += [
                    (start, start + d_l, position, "A", members),
                    (start, start + d_l, position, "B", members),
                ]
                start += d_l
        else:
            raise ValueError(f"sublora.allocation: '{allocation}' is not uniform, fixed or learned")
        self.projections = nn.ModuleList(
            make_projection(projection, stop - start, self._group_size(part, members), seed, self._group_name(g))
            for g, (start, stop, _, part, members) in enumerate(self.groups)
        )
        self._current: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._key: tuple[int, ...] | None = None
        self.hook: RemovableHandle | None = None  # the model's forward pre-hook that calls ``refresh``

    def _group_size(self, part: str, members: list[int]) -> int:
        return sum(math.prod(self._shape(i, p)) for i in members for p in part)

    def _group_name(self, g: int) -> str:
        start, stop, position, part, _ = self.groups[g]
        return f"{self.allocation}|{part}|{position}|{stop - start}"

    @property
    def num_parameters(self) -> int:
        """D: the LoRA parameters theta spans."""
        return sum(layer.size for layer in self.layers)

    def _shape(self, i: int, part: str) -> tuple[int, int]:
        layer = self.layers[i]
        return (layer.r, layer.d_in) if part == "A" else (layer.d_out, layer.r)

    def a0(self, i: int) -> torch.Tensor:
        return cast(torch.Tensor, getattr(self, f"a0_{i}"))

    def compute(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (A, B) = theta_0 + P alpha, in ``layers`` order."""
        deltas: dict[tuple[int, str], torch.Tensor] = {}
        for (start, stop, position, part, members), projection in zip(self.groups, self.projections):
            coords = self.alpha[start:stop]
            if position >= 0:
                assert self.gates is not None
                coords = split_learned(coords, self.gates[position])[0 if part == "A" else 1]
            flat = cast(Projection, projection)(coords)
            targets = [(i, p) for i in members for p in part]
            shapes = [self._shape(i, p) for i, p in targets]
            # one split, not a slice per layer: a slice's backward writes a zero tensor of the whole group's size
            # per layer (quadratic; it was 80 % of the subspace's CPU time), split's backward is a single concatenation
            for target, shape, piece in zip(targets, shapes, flat.split([r * c for r, c in shapes])):
                deltas[target] = piece.reshape(shape)
        return [(self.a0(i) + deltas[(i, "A")], deltas[(i, "B")]) for i in range(len(self.layers))]

    def refresh(self) -> None:
        """Recompute the layers' (A, B) for the next forward: always with gradients on (each backward needs its own
        graph), and without them only when alpha or the gates changed since the last computation."""
        key = (self.alpha._version, self.gates._version if self.gates is not None else -1)
        if torch.is_grad_enabled() or self._current is None or key != self._key:
            self._current = self.compute()
            self._key = None if torch.is_grad_enabled() else key

    def current(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._current is None:
            self.refresh()
        assert self._current is not None
        return self._current[i]


class SubspaceLoraLinear(WrappedProjection):
    """A frozen projection plus a LoRA path y = W x + s B A x whose (A, B) the shared ``Subspace`` computes."""

    _subspace: Subspace

    def __init__(self, base_layer: nn.Module, *, index: int, shape: LayerShape, scaling: float, subspace: Subspace):
        super().__init__()
        self.base_layer, self.index, self.shape, self.scaling = base_layer, index, shape, float(scaling)
        self.path = shape.path
        self.enabled = True
        object.__setattr__(self, "_subspace", subspace)  # shared by every layer: registered once, on the model

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return out
        a, b = self._subspace.current(self.index)
        delta = (x.to(a.dtype) @ a.T) @ b.T
        return out + (self.scaling * delta).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{self.path}: r={self.shape.r}, scaling={self.scaling}, enabled={self.enabled}"
