"""Plain LoRA through peft, laid out like peft's ``tuners/lora``: ``config`` (what), ``model`` (surgery and I/O),
``adapter`` (the adapter kind a client trains)."""

from .adapter import LoraAdapter
from .config import LoraSection
from .model import attach_lora, detach_lora, get_adapter_arrays, lora_config, save_peft_adapter, set_adapter_arrays

__all__ = [
    "LoraAdapter",
    "LoraSection",
    "attach_lora",
    "detach_lora",
    "get_adapter_arrays",
    "lora_config",
    "save_peft_adapter",
    "set_adapter_arrays",
]
