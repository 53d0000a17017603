"""Adapter kinds trained on top of a frozen (4-bit) base model. Only their parameters ever leave a client.

Each kind is one place (``lora/``, ``pqlora/``, ``experts/``: config, per-layer math, model surgery, the
client-side kind) and implements ``base.AdapterKind``; ``ADAPTER_KINDS`` is the one list of them. The dual-path
kinds (``lora/dual.py``, ``pqlora/dual.py``, ``experts/dual.py``) are thin subclasses that add the personal LoRA
of ``personal/``, which never travels. ``experts/`` is VEMoE's pool of LoRA experts with token routing;
``sublora/`` is LoRA in a random subspace (only alpha travels).
"""

from .base import AdapterKind, Arrays, ClientState, ReportsBound, UndeclaredStateError
from .experts.adapter import ExpertsAdapter
from .experts.dual import ExpertsDualAdapter
from .lora import LoraAdapter, attach_lora, get_adapter_arrays, lora_config, save_peft_adapter, set_adapter_arrays
from .lora.dual import LoraDualAdapter
from .pqlora import PQLoraAdapter
from .pqlora.dual import PQLoraDualAdapter
from .sublora import SubLoraAdapter

ADAPTER_KINDS: dict[str, type[AdapterKind]] = {
    kind.name: kind
    for kind in (
        LoraAdapter,
        PQLoraAdapter,
        LoraDualAdapter,
        PQLoraDualAdapter,
        ExpertsAdapter,
        ExpertsDualAdapter,
        SubLoraAdapter,
    )
}


def adapter_kind(name: str) -> type[AdapterKind]:
    """The adapter kind called ``name``."""
    if name not in ADAPTER_KINDS:
        raise ValueError(f"adapter: '{name}' is not an adapter kind (have {sorted(ADAPTER_KINDS)})")
    return ADAPTER_KINDS[name]


__all__ = [
    "ADAPTER_KINDS",
    "AdapterKind",
    "Arrays",
    "ClientState",
    "ReportsBound",
    "UndeclaredStateError",
    "adapter_kind",
    "attach_lora",
    "get_adapter_arrays",
    "lora_config",
    "save_peft_adapter",
    "set_adapter_arrays",
]
