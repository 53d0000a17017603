"""PQ-LoRA with a personal LoRA as its local path (SimGrad with ``simgrad.local-path = "lora"``).

h = W h + LoRA_personal(h) + beta * PQ(h): the personal LoRA (every block, ``personal.*``) trains each round and
stays in the client's ``ClientState`` (``personal.DualPath``); the PQ path is the global one alone
(``PQLoraConfig.trains_global``): it starts each message from what the server sent, trains, and is what is sent
(the active blocks, aligned by the strategy). Without a (1 - beta) factor on the LoRA: its trainable B already sets
its scale.
"""

from __future__ import annotations

from typing import ClassVar

from ..base import Arrays, ClientState
from ..personal import DualPath
from .adapter import PQLoraAdapter
from .model import get_pq_arrays, set_pq_arrays


class PQLoraDualAdapter(DualPath, PQLoraAdapter):
    """A trained, travelling PQ path beside a personal LoRA that never leaves the client (see the module docstring)."""

    name: ClassVar[str] = "pqlora-dual"
    trains_global: ClassVar[bool] = True

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        """The client's gates and personal LoRA; the PQ path starts from the received (else kept) global one."""
        super().begin(state, received)
        set_pq_arrays(self.model, get_pq_arrays(self.model, "global"), part="local")
