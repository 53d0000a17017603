"""Adapter kinds trained on top of a frozen (4-bit) base model. Only their parameters ever leave a client.

Each kind is one place (``lora/``, ``pqlora/``, ``experts/``: config, per-layer math, model surgery, the
client-side kind) and implements ``base.AdapterKind`` by subclassing ``base.AdapterBase``, whose defaults it
overrides only where it differs; ``ADAPTER_KINDS`` is the one list of them. The dual-path kinds (``lora/dual.py``,
``pqlora/dual.py``, ``experts/dual.py``) mix ``personal.DualPath`` into a kind: the personal LoRA of
``personal/``, which never travels. ``experts/`` is VEMoE's pool of LoRA experts with token routing;
``sublora/`` is LoRA in a random subspace (only alpha travels).
"""

from collections.abc import Callable

from .base import AdapterBase, AdapterKind, Arrays, ClientState, ReportsBound, UndeclaredStateError, checked_kind
from .experts.adapter import ExpertsAdapter
from .experts.dual import ExpertsDualAdapter
from .lora import LoraAdapter, attach_lora, get_adapter_arrays, lora_config, save_peft_adapter, set_adapter_arrays
from .lora.dual import LoraDualAdapter
from .pqlora import PQLoraAdapter
from .pqlora.dual import PQLoraDualAdapter
from .sublora import SubLoraAdapter

ADAPTER_KINDS: dict[str, type[AdapterKind]] = {
    kind.name: checked_kind(kind)
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


def kind_that_fits(name: str, fits: Callable[[type[AdapterKind]], bool], what: str) -> str:
    """``name`` when it names an adapter kind ``fits`` accepts, else ValueError naming the kinds it accepts (for a
    config key that picks a kind: ``what`` says what they are, e.g. "that FedAvg averages whole")."""
    allowed = sorted(kind for kind, cls in ADAPTER_KINDS.items() if fits(cls))
    if name not in allowed:
        raise ValueError(f"'{name}' is not an adapter kind {what} (have: {', '.join(allowed)})")
    return name


__all__ = [
    "ADAPTER_KINDS",
    "AdapterBase",
    "AdapterKind",
    "Arrays",
    "ClientState",
    "ReportsBound",
    "UndeclaredStateError",
    "adapter_kind",
    "kind_that_fits",
    "attach_lora",
    "get_adapter_arrays",
    "lora_config",
    "save_peft_adapter",
    "set_adapter_arrays",
]
