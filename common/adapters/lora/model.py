"""LoRA model surgery through peft: attach, detach, read and write the adapter as named float32 arrays, save a
PEFT directory.

The arrays use peft's own state-dict names (``get_peft_model_state_dict``), so what travels, what the server
checkpoints and what ``PeftModel.from_pretrained`` loads are the same keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import torch

from .config import LoraSection


def lora_config(cfg: LoraSection, base_model_name: str = ""):
    from peft import LoraConfig

    rank_pattern, alpha_pattern = cfg.peft_patterns()
    return LoraConfig(
        r=cfg.r,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        # cast: peft annotates lora_alpha as int, but only divides by it (scaling = lora_alpha / r); a float alpha is
        # intended and works.
        lora_alpha=cast(int, cfg.alpha),
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name,
    )


def attach_lora(model, cfg: LoraSection, seed: int = 0):
    """Wrap a frozen base model with a LoRA adapter; the initial A is drawn from ``seed`` (B starts at zero)."""
    from peft import get_peft_model

    missing = [m for m in cfg.target_modules if not any(n.endswith(m) for n, _ in model.named_modules())]
    if missing:
        raise ValueError(f"lora.target-modules: {missing} match no module of the base model")
    torch.manual_seed(seed)
    return get_peft_model(model, lora_config(cfg))


def detach_lora(peft_model):
    """Remove the LoRA layers; the base model as it was before ``attach_lora``."""
    return peft_model.unload()


def get_adapter_arrays(peft_model) -> dict[str, np.ndarray]:
    """The adapter's trainable weights as ``{name: float32 array}``, names sorted for a stable wire order."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    # copies: on the CPU in float32, .numpy() would share the live weights (and change as they train)
    return {k: state[k].detach().to(torch.float32).cpu().numpy().copy() for k in sorted(state)}


def set_adapter_arrays(peft_model, arrays: dict[str, np.ndarray]) -> None:
    """Load named arrays into the adapter; every adapter weight must be given, with its exact shape."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    current = get_peft_model_state_dict(peft_model)
    if set(arrays) != set(current):
        raise KeyError(
            f"adapter keys differ: missing {sorted(set(current) - set(arrays))[:3]}, "
            f"extra {sorted(set(arrays) - set(current))[:3]}"
        )
    state = {}
    for key, ref in current.items():
        if tuple(arrays[key].shape) != tuple(ref.shape):
            raise ValueError(f"adapter weight {key}: shape {arrays[key].shape} != expected {tuple(ref.shape)}")
        state[key] = torch.from_numpy(np.asarray(arrays[key], dtype=np.float32)).to(ref.dtype)
    set_peft_model_state_dict(peft_model, state)


def save_peft_adapter(
    arrays: dict[str, np.ndarray], cfg: LoraSection, base_model_name: str, out_dir: str | Path
) -> Path:
    """Write a PEFT adapter directory (``adapter_config.json`` + safetensors) without loading the base model."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora_config(cfg, base_model_name).save_pretrained(str(out))
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()},
        str(out / "adapter_model.safetensors"),
    )
    return out
