"""Adapters trained on top of a frozen (4-bit) base model. Only their parameters ever leave a client."""

from .lora import attach_lora, get_adapter_arrays, lora_config, save_peft_adapter, set_adapter_arrays

__all__ = ["attach_lora", "get_adapter_arrays", "lora_config", "save_peft_adapter", "set_adapter_arrays"]
