"""Model surgery for a pool of LoRA experts: attach to every block's target projections, move one expert (or the
routers) in and out as named arrays, route, disable, detach.

An expert's arrays use peft's names for a LoRA layer (``<module path>.lora_A.weight`` r x d_in and
``.lora_B.weight`` d_out x r), so every LoRA tool (``common.adapters.lora.ranks``) reads an expert; a router is
``<module path>.router.weight`` (K_max x d_in).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from ..lora.ranks import PEFT_PREFIX
from ..pqlora.model import find_decoder_blocks
from ..wrapping import paths_disabled, unwrap, wrapped_layers
from .config import ExpertsSection
from .layer import ExpertLinear, ExpertRouting

Arrays = dict[str, np.ndarray]


def attach_experts(model: nn.Module, section: ExpertsSection, seed: int) -> nn.Module:
    """Wrap ``section.target_modules`` of every block in ``ExpertLinear``, in place; freeze the base. Every slot's
    A is drawn from a seed of (run seed, module path, slot), so clients of one base model agree on a new expert."""
    if expert_layers(model, required=False):
        raise ValueError("model already has experts attached")
    blocks = find_decoder_blocks(model)
    block_ids = {id(block) for block in blocks}
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if name.split(".")[-1] in section.target_modules and _in_a_block(model, name, block_ids)
    ]
    found = {name.split(".")[-1] for name, _ in targets}
    if missing := sorted(set(section.target_modules) - found):
        raise ValueError(f"experts.target-modules: {missing} not found in the model's blocks")
    for param in model.parameters():
        param.requires_grad_(False)
    routing = ExpertRouting(section.gamma)
    model.experts_routing = routing
    for name, module in targets:
        # the base model's module path, also inside a peft wrapper (a personal LoRA beside the pool): the wire names
        # and each new expert's A do not depend on it
        path = name.removeprefix(PEFT_PREFIX)
        layer = ExpertLinear(
            module, path=path, k_max=section.k_max, r=section.r, scaling=section.scaling, routing=routing
        )
        with torch.no_grad():
            for slot in range(section.k_max):
                layer.lora_A[slot].copy_(initial_a(seed, path, slot, section.r, layer.in_features))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    routing.to(next(blocks[0].parameters()).device)
    return model


def _in_a_block(model: nn.Module, name: str, block_ids: set[int]) -> bool:
    parts = name.split(".")
    return any(id(model.get_submodule(".".join(parts[:i]))) in block_ids for i in range(1, len(parts)))


def initial_a(seed: int, path: str, slot: int, r: int, d_in: int) -> torch.Tensor:
    """A new expert's A: uniform in +-1/sqrt(d_in) (peft's kaiming-uniform bound), from a crc32 seed so it is the
    same in every process."""
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"experts|{seed}|{path}|{slot}".encode()))
    bound = 1.0 / math.sqrt(d_in)
    return (torch.rand(r, d_in, generator=gen, dtype=torch.float32) * 2 - 1) * bound


def detach_experts(model: nn.Module) -> nn.Module:
    """Undo ``attach_experts``: every ExpertLinear back to its base layer, the routing removed."""
    unwrap(model, ExpertLinear)
    if hasattr(model, "experts_routing"):
        del model.experts_routing
    return model


def expert_layers(model: nn.Module, required: bool = True) -> list[ExpertLinear]:
    missing = "model has no experts; call attach_experts first"
    return wrapped_layers(model, ExpertLinear, lambda layer: layer.path, missing, required)


def get_expert(model: nn.Module, slot: int) -> Arrays:
    """float32 copies of one expert's LoRA pairs, peft-named, sorted."""
    out = {}
    for layer in expert_layers(model):
        out[f"{layer.path}.lora_A.weight"] = layer.lora_A[slot].detach().cpu().numpy().copy()
        out[f"{layer.path}.lora_B.weight"] = layer.lora_B[slot].detach().cpu().numpy().copy()
    return dict(sorted(out.items()))


def set_expert(model: nn.Module, slot: int, arrays: Arrays) -> None:
    """Load one expert; every array of it must be given with its exact shape."""
    layers = expert_layers(model)
    expected = {f"{layer.path}.lora_{part}.weight" for layer in layers for part in "AB"}
    if set(arrays) != expected:
        raise KeyError(
            f"expert arrays differ: missing {sorted(expected - set(arrays))[:2]}, extra "
            f"{sorted(set(arrays) - expected)[:2]}"
        )
    with torch.no_grad():
        for layer in layers:
            for part, param in (("A", layer.lora_A), ("B", layer.lora_B)):
                value = torch.as_tensor(np.asarray(arrays[f"{layer.path}.lora_{part}.weight"]), dtype=torch.float32)
                if value.shape != param[slot].shape:
                    raise ValueError(
                        f"{layer.path}.lora_{part}.weight: shape {tuple(value.shape)} != {tuple(param[slot].shape)}"
                    )
                param[slot].copy_(value)


def get_routers(model: nn.Module) -> Arrays:
    return {f"{layer.path}.router.weight": layer.router.detach().cpu().numpy().copy() for layer in expert_layers(model)}


def set_routers(model: nn.Module, arrays: Arrays) -> None:
    with torch.no_grad():
        for layer in expert_layers(model):
            layer.router.copy_(torch.as_tensor(np.asarray(arrays[f"{layer.path}.router.weight"]), dtype=torch.float32))


def trainable(model: nn.Module, train: bool = True) -> list[nn.Parameter]:
    """The experts' and routers' parameters, made trainable (a forward only reaches the routed slots, so only
    they get gradients); the base stays frozen."""
    params = [p for layer in expert_layers(model) for p in (layer.lora_A, layer.lora_B, layer.router)]
    for param in params:
        param.requires_grad_(train)
    return params


def routing_of(model: nn.Module) -> ExpertRouting:
    routing = getattr(model, "experts_routing", None)
    if not isinstance(routing, ExpertRouting):
        raise ValueError("model has no experts; call attach_experts first")
    return routing


@contextmanager
def routed(model: nn.Module, slots: list[int], r: list[float]) -> Iterator[nn.Module]:
    """Run the model with tokens routed between ``slots`` (responsibilities ``r``), then restore the routing."""
    routing = routing_of(model)
    before = (routing.slots, routing.log_r)
    try:
        routing.route(slots, r)
        yield model
    finally:
        routing.slots, routing.log_r = before


@contextmanager
def experts_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the pure base model inside the block (e.g. a frozen probe)."""
    with paths_disabled(expert_layers(model)):
        yield model
