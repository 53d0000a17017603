"""SubLoRA model surgery: attach to every block's target projections, move alpha (and the gates) in and out as
named arrays, materialise theta_0 + P alpha as a PEFT LoRA adapter, disable, detach.

The wire arrays are ``alpha`` (d,) and, in ``learned`` mode, ``gates`` (one logit per block). The exported adapter
uses peft's names (``base_model.model.<module path>.lora_A.weight``), so ``PeftModel.from_pretrained`` loads it on
the same base model with nothing of this package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..lora.config import LoraSection
from ..lora.model import save_peft_adapter
from ..pqlora.model import find_decoder_blocks
from ..wrapping import paths_disabled, unwrap, wrapped_layers
from .config import SubLoraSection
from .layer import LayerShape, Subspace, SubspaceLoraLinear

Arrays = dict[str, np.ndarray]
ALPHA, GATES = "alpha", "gates"
DENSE_LIMIT = 1 << 28  # float32 numbers a dense P may hold (1 GiB)


def attach_sublora(model: nn.Module, section: SubLoraSection) -> nn.Module:
    """Wrap ``section.target_modules`` of every transformer block in ``SubspaceLoraLinear``, in place; freeze the
    base; the subspace (alpha, gates, theta_0, P) becomes ``model.sublora_subspace``."""
    if sublora_layers(model, required=False):
        raise ValueError("model already has a SubLoRA adapter attached")
    blocks = find_decoder_blocks(model)
    targets: list[tuple[str, nn.Module, int]] = []
    for position, block in enumerate(blocks):
        prefix = next(name for name, module in model.named_modules() if module is block)
        for name, module in block.named_modules():
            if name.split(".")[-1] in section.target_modules:
                targets.append((f"{prefix}.{name}", module, position))
    if missing := sorted(set(section.target_modules) - {path.split(".")[-1] for path, _, _ in targets}):
        raise ValueError(f"sublora.target-modules: {missing} not found in the model's blocks")
    targets.sort(key=lambda item: item[0])
    shapes = []
    for path, module, position in targets:
        d_in, d_out = int(getattr(module, "in_features", 0)), int(getattr(module, "out_features", 0))
        if not d_in or not d_out:
            raise ValueError(f"sublora.target-modules: {path} has no in_features/out_features")
        if section.r > min(d_in, d_out):
            raise ValueError(f"sublora.r: {section.r} exceeds min(d_in, d_out) of {path}")
        shapes.append(LayerShape(path, position, section.r, d_in, d_out))
    total = sum(shape.size for shape in shapes)
    if section.projection == "dense" and total * section.intrinsic_dim > DENSE_LIMIT:
        raise ValueError(
            f"sublora.projection: 'dense' would hold D x d = {total:,} x {section.intrinsic_dim:,} numbers "
            f"({total * section.intrinsic_dim * 4 / 2**30:.1f} GiB); use 'fastfood'"
        )
    for param in model.parameters():
        param.requires_grad_(False)
    subspace = Subspace(
        shapes, section.intrinsic_dim, section.allocation, section.allocation_ratio, section.projection, section.seed
    )
    subspace.to(next(blocks[0].parameters()).device)
    model.sublora_subspace = subspace
    subspace.hook = model.register_forward_pre_hook(lambda module, args: subspace.refresh())
    for index, ((path, module, _), shape) in enumerate(zip(targets, shapes)):
        layer = SubspaceLoraLinear(module, index=index, shape=shape, scaling=section.scaling, subspace=subspace)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model


def subspace_of(model: nn.Module) -> Subspace:
    subspace = getattr(model, "sublora_subspace", None)
    if not isinstance(subspace, Subspace):
        raise ValueError("model has no SubLoRA adapter; call attach_sublora first")
    return subspace


def sublora_layers(model: nn.Module, required: bool = True) -> list[SubspaceLoraLinear]:
    missing = "model has no SubLoRA adapter; call attach_sublora first"
    return wrapped_layers(model, SubspaceLoraLinear, lambda layer: layer.index, missing, required)


def detach_sublora(model: nn.Module) -> nn.Module:
    """Undo ``attach_sublora``: every wrapped layer back to its base layer, the subspace and its hook removed."""
    unwrap(model, SubspaceLoraLinear)
    subspace = getattr(model, "sublora_subspace", None)
    if isinstance(subspace, Subspace):
        if subspace.hook is not None:
            subspace.hook.remove()
        del model.sublora_subspace
    return model


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """alpha and the gates, made trainable (everything else is frozen)."""
    subspace = subspace_of(model)
    params = [p for p in (subspace.alpha, subspace.gates) if p is not None]
    for param in params:
        param.requires_grad_(True)
    return params


def get_arrays(model: nn.Module) -> Arrays:
    """What a client sends: float32 copies of alpha (and the gates)."""
    subspace = subspace_of(model)
    out = {ALPHA: subspace.alpha.detach().cpu().numpy().copy()}
    if subspace.gates is not None:
        out[GATES] = subspace.gates.detach().cpu().numpy().copy()
    return out


def set_arrays(model: nn.Module, arrays: Arrays) -> None:
    """Load alpha (and the gates); both must be given with their exact shapes."""
    subspace = subspace_of(model)
    params = {ALPHA: subspace.alpha, **({GATES: subspace.gates} if subspace.gates is not None else {})}
    if set(arrays) != set(params):
        raise KeyError(f"SubLoRA arrays are {sorted(params)}, got {sorted(arrays)}")
    with torch.no_grad():
        for name, param in params.items():
            value = torch.as_tensor(np.asarray(arrays[name], dtype=np.float32))
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"SubLoRA {name}: shape {tuple(value.shape)} != expected {tuple(param.shape)}")
            param.copy_(value.to(param.device))


def materialise(model: nn.Module) -> Arrays:
    """theta_0 + P alpha as peft-named LoRA arrays (``base_model.model.<path>.lora_A.weight``, ``lora_B``)."""
    subspace = subspace_of(model)
    with torch.no_grad():
        pairs = subspace.compute()
    out = {}
    for shape, (a, b) in zip(subspace.layers, pairs):
        out[f"base_model.model.{shape.path}.lora_A.weight"] = a.detach().float().cpu().numpy().copy()
        out[f"base_model.model.{shape.path}.lora_B.weight"] = b.detach().float().cpu().numpy().copy()
    return out


def lora_section(section: SubLoraSection) -> LoraSection:
    """The plain LoRA the exported adapter is (same rank, scale and modules)."""
    return LoraSection(r=section.r, alpha=section.lora_alpha, target_modules=list(section.target_modules))


def save_materialised(model: nn.Module, section: SubLoraSection, base_model_name: str, out_dir: Path) -> Path:
    """A PEFT LoRA directory of theta_0 + P alpha, plus ``subspace.npz`` (alpha, gates) beside it."""
    out = save_peft_adapter(materialise(model), lora_section(section), base_model_name, out_dir)
    arrays: dict[str, Any] = dict(get_arrays(model))
    np.savez(out / "subspace.npz", **arrays)
    return out


@contextmanager
def sublora_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the pure base model inside the block."""
    with paths_disabled(sublora_layers(model)):
        yield model
