"""A client's personal LoRA: the local path that trains every round beside a travelling adapter and never leaves
the client (FedDPA / FDLoRA style). ``config`` (what: ``personal.*``), ``model`` (peft surgery and I/O), ``path``
(the piece the dual-path adapter kinds compose: kept in ``ClientState``, trained with its own learning rate),
``dual`` (``DualPath``: the mixin that makes a kind dual-path)."""

from .config import PersonalSection
from .dual import DualPath
from .model import PERSONAL_ADAPTER, add_personal_lora, get_personal_arrays, set_personal_arrays
from .path import PERSONAL_STATE, PersonalLora

__all__ = [
    "PERSONAL_ADAPTER",
    "PERSONAL_STATE",
    "DualPath",
    "PersonalLora",
    "PersonalSection",
    "add_personal_lora",
    "get_personal_arrays",
    "set_personal_arrays",
]
