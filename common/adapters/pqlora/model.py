"""PQ-LoRA model surgery: attach to the last blocks, move P/Q and local state in and out, save and load.

Arrays are named ``block{i}.{proj}.P`` / ``.Q`` with i counted from the first adapted block, so models of
different depth and width expose the same names and shapes (r x r, r): that is what lets heterogeneous clients
share P/Q. One process serves several virtual clients, hence the local-state swap helpers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..wrapping import paths_disabled, unwrap
from .config import PQLoraConfig
from .layer import PQLoraGates, PQLoraLinear

CONFIG_FILE = "pqlora_config.json"
WEIGHTS_FILE = "pqlora_model.safetensors"
_PARTS = {"local": ("P_L", "Q_L"), "global": ("P_G", "Q_G")}
_LOCAL = {"P": "P_L", "Q": "Q_L"}
_ALL = {a: a for a in ("A", "B", "P_L", "Q_L", "P_G", "Q_G")}  # what save/load moves (plus the gate logits)


def find_decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: ``model.model.layers`` (Llama/Qwen2), else the longest ModuleList named layers/h.

    The generic search walks ``named_modules`` so it also finds the blocks through a peft (or other) wrapper.
    """
    inner = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(inner, nn.ModuleList) and len(inner) > 0:
        return inner
    best: nn.ModuleList | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h"):
            if best is None or len(module) > len(best):
                best = module
    if best is None or len(best) == 0:
        raise ValueError(
            f"no transformer blocks found in {type(model).__name__}: expected a non-empty "
            "nn.ModuleList named 'layers' or 'h' (e.g. model.model.layers)"
        )
    return best


def attach_pqlora(model: nn.Module, cfg: PQLoraConfig) -> nn.Module:
    """Wrap ``cfg.target_modules`` of the last ``cfg.num_blocks`` blocks in PQLoraLinear, in place; freeze the base."""
    if _layers(model, required=False):
        raise ValueError("model already has PQ-LoRA attached")
    blocks = find_decoder_blocks(model)
    if cfg.num_blocks > len(blocks):
        raise ValueError(f"pqlora.blocks (num_blocks): {cfg.num_blocks} exceeds the {len(blocks)} blocks of the model")
    first = len(blocks) - cfg.num_blocks
    # Resolve every target before touching the model, so a bad config leaves it unchanged.
    targets = []
    for i in range(cfg.num_blocks):
        block = blocks[first + i]
        for proj in cfg.target_modules:
            hits = [n for n, _ in block.named_modules() if n.split(".")[-1] == proj]
            if len(hits) != 1:
                what = "missing" if not hits else f"ambiguous ({hits})"
                raise ValueError(f"target_modules: {proj} is {what} in block {first + i} of the model")
            base = block.get_submodule(hits[0])
            d_in, d_out = getattr(base, "in_features", None), getattr(base, "out_features", None)
            if d_in is None or d_out is None:
                raise ValueError(f"target_modules: {proj} in block {first + i} has no in_features/out_features")
            if cfg.r > min(d_in, d_out):
                raise ValueError(
                    f"r: {cfg.r} exceeds min(d_in, d_out) = {min(d_in, d_out)} of {proj} in block {first + i}"
                )
            targets.append((i, proj, block, hits[0]))
    for param in model.parameters():
        param.requires_grad_(False)

    device = next(blocks[first].parameters()).device
    gates = PQLoraGates(cfg.num_blocks, cfg.gate_init, config=cfg).to(device)
    model.add_module("pqlora_gates", gates)
    for i, proj, block, path in targets:
        parent_path, _, child = path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        base = getattr(parent, child)
        layer = PQLoraLinear(
            base,
            block=i,
            proj=proj,
            r=cfg.r,
            scaling=cfg.scaling,
            seed=cfg.seed,
            gates=gates,
            trains_global=cfg.trains_global,
        )
        setattr(parent, child, layer)
    return model


def detach_pqlora(model: nn.Module) -> nn.Module:
    """Undo ``attach_pqlora``: every PQLoraLinear back to its base layer, the gates removed."""
    unwrap(model, PQLoraLinear)
    if hasattr(model, "pqlora_gates"):
        del model.pqlora_gates
    return model


def get_pq_arrays(model: nn.Module, part: str = "local", blocks: Iterable[int] | None = None) -> dict[str, np.ndarray]:
    """float32 copies of P_L/Q_L (``part="local"``) or P_G/Q_G (``"global"``), names sorted, optionally some blocks."""
    p_attr, q_attr = _part(part)
    keep = None if blocks is None else set(blocks)
    out = {}
    for layer in _layers(model):
        if keep is None or layer.block in keep:
            out[f"{layer.name}.P"] = _np(getattr(layer, p_attr))
            out[f"{layer.name}.Q"] = _np(getattr(layer, q_attr))
    return dict(sorted(out.items()))


def set_pq_arrays(model: nn.Module, arrays: dict[str, np.ndarray], part: str = "global") -> None:
    """Load P/Q into the local parameters or the global buffers; a subset is fine, unknown names/shapes are not."""
    _copy_checked(_slots(model, dict(zip(("P", "Q"), _part(part))), gates=False), arrays)


def get_gates(model: nn.Module) -> list[float]:
    """beta = sigmoid(gate logit) of every adapted block, in block order."""
    gates = _gates(model)
    return [float(gates.beta(i).detach()) for i in range(len(gates.logits))]


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The gate logit of every adapted block (trainable or not), in block order."""
    return list(_gates(model).logits)


def get_local_state(model: nn.Module) -> dict[str, np.ndarray]:
    """One client's private state: P_L/Q_L (``block{i}.{proj}.P``/``.Q``) and gate logits (``block{i}.gate``, 0-d)."""
    return {k: _np(v) for k, v in sorted(_slots(model, _LOCAL).items())}


def set_local_state(model: nn.Module, state: dict[str, np.ndarray]) -> None:
    """Swap a client's local state in; every key of ``get_local_state`` is required (no leftovers of another client)."""
    slots = _slots(model, _LOCAL)
    missing = sorted(set(slots) - set(state))
    if missing:
        raise KeyError(f"local state lacks {missing[:3]}")
    _copy_checked(slots, state)


def reset_local_state(model: nn.Module) -> None:
    """Back to the initial local state: zero P_L/Q_L, gate logits at ``gate_init``."""
    with torch.no_grad():
        for name, tensor in _slots(model, _LOCAL).items():
            tensor.fill_(_gates(model).gate_init if name.endswith(".gate") else 0.0)


def set_trainable_blocks(model: nn.Module, active: Iterable[int] | None) -> None:
    """requires_grad only for P_L, Q_L and the gate of the ``active`` blocks (None: all); everything else frozen."""
    gates = _gates(model)
    n = len(gates.logits)
    chosen = set(range(n)) if active is None else set(active)
    bad = sorted(b for b in chosen if not 0 <= b < n)
    if bad:
        raise ValueError(f"active: blocks {bad} out of range 0..{n - 1}")
    for param in model.parameters():
        param.requires_grad_(False)
    for layer in _layers(model):
        if layer.block in chosen:
            layer.P_L.requires_grad_(True)
            layer.Q_L.requires_grad_(True)
    for b in chosen:
        gates.logits[b].requires_grad_(True)


def block_grad_norms(model: nn.Module) -> list[float]:
    """Per block, sqrt of the summed squared ``.grad`` of its P_L and Q_L (0.0 where there is no grad)."""
    sums = [0.0] * len(_gates(model).logits)
    for layer in _layers(model):
        for p in (layer.P_L, layer.Q_L):
            if p.grad is not None:
                sums[layer.block] += float(p.grad.detach().double().pow(2).sum())
    return [s**0.5 for s in sums]


@contextmanager
def adapters_disabled(model: nn.Module):
    """Temporarily run the pure base model (every PQ layer returns the base output), e.g. for a frozen probe."""
    with paths_disabled(_layers(model)):
        yield model


def pq_num_floats(cfg: PQLoraConfig) -> int:
    """Numbers that travel per round with all blocks active: P (r x r) and Q (r) per adapted projection."""
    return cfg.num_blocks * len(cfg.target_modules) * (cfg.r * cfg.r + cfg.r)


def save_pq_adapter(model: nn.Module, cfg: PQLoraConfig, out_dir: str | Path, base_model_name: str = "") -> Path:
    """Write ``pqlora_config.json`` (config, base model, per-layer d_in/d_out) and ``pqlora_model.safetensors``
    (A, B, P_L, Q_L, P_G, Q_G, gate logits). A/B too: a reload must not depend on the RNG of a torch build."""
    from safetensors.torch import save_file

    _check_config(model, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "pqlora",
        "version": 1,
        "config": cfg.to_dict(),
        "base_model_name": base_model_name,
        "layers": _shapes(model),
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    save_file(
        {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in _slots(model, _ALL).items()},
        str(out / WEIGHTS_FILE),
    )
    return out


def load_pq_adapter(model: nn.Module, in_dir: str | Path) -> nn.Module:
    """Load a saved adapter into a model that already has PQ-LoRA attached with the same config and shapes."""
    from safetensors.torch import load_file

    src = Path(in_dir)
    meta = json.loads((src / CONFIG_FILE).read_text())
    _check_config(model, PQLoraConfig.from_dict(meta["config"]))
    if meta.get("layers") != _shapes(model):
        raise ValueError(f"layers: saved shapes {meta.get('layers')} differ from the model's {_shapes(model)}")
    tensors = load_file(str(src / WEIGHTS_FILE))
    slots = _slots(model, _ALL)
    if set(tensors) != set(slots):
        raise KeyError(
            f"{WEIGHTS_FILE}: keys differ (missing {sorted(set(slots) - set(tensors))[:3]}, "
            f"extra {sorted(set(tensors) - set(slots))[:3]})"
        )
    _copy_checked(slots, {k: v.numpy() for k, v in tensors.items()})
    return model


# --- helpers -------------------------------------------------------------------------------------------------


def _layers(model: nn.Module, required: bool = True) -> list[PQLoraLinear]:
    layers = [m for m in model.modules() if isinstance(m, PQLoraLinear)]
    if required and not layers:
        raise ValueError("model has no PQ-LoRA layers; call attach_pqlora first")
    return sorted(layers, key=lambda layer: (layer.block, layer.proj))


def _gates(model: nn.Module) -> PQLoraGates:
    found = [m for m in model.modules() if isinstance(m, PQLoraGates)]
    if len(found) != 1:
        raise ValueError(f"expected one PQ-LoRA gate container, found {len(found)}; call attach_pqlora first")
    return found[0]


def _part(part: str) -> tuple[str, str]:
    if part not in _PARTS:
        raise ValueError(f"part: must be 'local' or 'global', got {part!r}")
    return _PARTS[part]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()


def _slots(model: nn.Module, attrs: dict[str, str], gates: bool = True) -> dict[str, torch.Tensor]:
    # {array name: live tensor}; ``attrs`` maps the name suffix to the layer attribute holding it.
    slots = {f"{layer.name}.{k}": getattr(layer, a) for layer in _layers(model) for k, a in attrs.items()}
    if gates:
        slots.update({f"block{i}.gate": logit for i, logit in enumerate(_gates(model).logits)})
    return slots


def _copy_checked(slots: dict[str, torch.Tensor], arrays: dict[str, np.ndarray]) -> None:
    # Validate everything first: a half-applied update would mix two clients' (or two rounds') states.
    for name, value in arrays.items():
        if name not in slots:
            raise KeyError(f"{name}: unknown PQ-LoRA array")
        if tuple(np.shape(value)) != tuple(slots[name].shape):
            raise ValueError(f"{name}: shape {tuple(np.shape(value))} != expected {tuple(slots[name].shape)}")
    with torch.no_grad():
        for name, value in arrays.items():
            dst = slots[name]
            dst.copy_(torch.as_tensor(np.asarray(value, dtype=np.float32)).to(dst.device, dst.dtype))


def _shapes(model: nn.Module) -> dict[str, dict[str, int]]:
    return {layer.name: {"d_in": layer.in_features, "d_out": layer.out_features} for layer in _layers(model)}


def _check_config(model: nn.Module, cfg: PQLoraConfig) -> None:
    attached = _gates(model).config
    if attached is not None and attached != cfg:
        diff = sorted(k for k, v in cfg.to_dict().items() if attached.to_dict()[k] != v)
        raise ValueError(f"{', '.join(diff)}: PQ-LoRA config differs from the one attached to the model")
