"""Personal-LoRA surgery through peft: a LoRA named ``personal`` beside any other adapter, read and written as
named float32 arrays with peft's own state-dict names (so its export loads with ``PeftModel.from_pretrained``)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..lora.model import lora_config
from .config import PersonalSection

PERSONAL_ADAPTER = "personal"  # the peft adapter name; never the travelling ("default") one


def add_personal_lora(model: nn.Module, cfg: PersonalSection, seed: int) -> nn.Module:
    """``model`` with a LoRA adapter named ``personal`` (a PeftModel); enabled beside the adapters it already has.

    Its A is drawn from ``seed`` (B starts at zero, so it starts as the identity). A plain model is wrapped; a
    PeftModel gets a second adapter, and both stay enabled (their outputs add up)."""
    from peft import PeftModel, get_peft_model

    missing = [m for m in cfg.target_modules if not any(n.endswith(m) for n, _ in model.named_modules())]
    if missing:
        raise ValueError(f"personal.target-modules: {missing} match no module of the base model")
    # Another seed than the travelling LoRA's: the two paths must not start from the same A.
    torch.manual_seed(seed + 7_654_321)
    if not isinstance(model, PeftModel):
        return get_peft_model(model, lora_config(cfg), adapter_name=PERSONAL_ADAPTER)
    tuner = cast(Any, model.base_model)  # peft's LoraModel (nn.Module attribute access is typed Tensor | Module)
    enabled = list(tuner.active_adapters)
    model.add_adapter(PERSONAL_ADAPTER, lora_config(cfg))
    tuner.set_adapter([*enabled, PERSONAL_ADAPTER])
    return model


def _personal_slots(model: nn.Module) -> dict[str, nn.Parameter]:
    # {peft export name: live weight}. The export name is peft's state-dict name (no adapter name), without the
    # ``.base_layer`` a wrapper around peft's layer adds (PQ-LoRA wraps it), so it loads on a plain base model.
    tag = f".{PERSONAL_ADAPTER}."
    slots = {}
    for name, param in model.named_parameters():
        if tag in name and ".lora_" in name:
            slots[name.replace(tag, ".").replace(".base_layer.lora_", ".lora_")] = param
    return dict(sorted(slots.items()))


def personal_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The personal LoRA's weights (every ``lora_A``/``lora_B`` of the ``personal`` adapter)."""
    return list(_personal_slots(model).values())


def get_personal_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The personal LoRA as ``{peft state-dict name: float32 array}`` (copies), names sorted."""
    return {k: p.detach().to("cpu", torch.float32).numpy().copy() for k, p in _personal_slots(model).items()}


def set_personal_arrays(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load the whole personal LoRA (every name of ``get_personal_arrays``, exact shapes), all or nothing."""
    slots = _personal_slots(model)
    if set(arrays) != set(slots):
        raise KeyError(
            f"personal LoRA keys differ: missing {sorted(set(slots) - set(arrays))[:3]}, "
            f"extra {sorted(set(arrays) - set(slots))[:3]}"
        )
    for key, param in slots.items():
        if tuple(np.shape(arrays[key])) != tuple(param.shape):
            raise ValueError(f"personal LoRA weight {key}: shape {np.shape(arrays[key])} != {tuple(param.shape)}")
    with torch.no_grad():
        for key, param in slots.items():
            param.copy_(torch.as_tensor(np.asarray(arrays[key], dtype=np.float32)).to(param.device, param.dtype))
