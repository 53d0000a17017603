"""PQ-LoRA with a personal LoRA as its local path (SimGrad with ``simgrad.local-path = "lora"``).

h = W h + LoRA_personal(h) + beta * PQ(h): the personal LoRA (every block, ``personal.*``) trains each round and
stays in the client's ``ClientState``; the PQ path is the global one alone (``PQLoraConfig.trains_global``): it
starts each message from what the server sent, trains, and is what is sent (the active blocks, aligned by the
strategy). Without a (1 - beta) factor on the LoRA: its trainable B already sets its scale.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from ..base import Arrays, ClientState
from ..personal import PERSONAL_STATE, PersonalLora, PersonalSection
from .adapter import PQLoraAdapter
from .model import adapters_disabled, detach_pqlora, get_pq_arrays, set_pq_arrays

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section


class PQLoraDualAdapter(PQLoraAdapter):
    """A trained, travelling PQ path beside a personal LoRA that never leaves the client (see the module docstring)."""

    name: ClassVar[str] = "pqlora-dual"
    extra_sections: ClassVar[tuple[type[Section], ...]] = (PersonalSection,)
    state_keys: ClassVar[tuple[str, ...]] = (*PQLoraAdapter.state_keys, PERSONAL_STATE)
    trains_global: ClassVar[bool] = True

    def __init__(self, base: nn.Module, cfg: RunConfig) -> None:
        self.personal = PersonalLora(base, cfg)
        super().__init__(self.personal.model, cfg)  # PQ layers wrap peft's LoRA layers

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        return f"{super().settings(cfg)} personal={cfg.section(PersonalSection).model_dump_json()}"

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        """The client's gates and personal LoRA; the PQ path starts from the received (else kept) global one."""
        super().begin(state, received)
        set_pq_arrays(self.model, get_pq_arrays(self.model, "global"), part="local")
        self.personal.begin(state)

    def prepare_training(self, active: list[int] | None) -> None:
        super().prepare_training(active)
        self.personal.make_trainable()

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        return self.with_gate_group(self.personal.lr_groups(self.model))

    def end(self, state: ClientState) -> None:
        super().end(state)
        self.personal.end(state)

    @contextmanager
    def disabled(self) -> Iterator[Any]:
        with adapters_disabled(self.model), cast(Any, self.model).disable_adapter():  # a PeftModel
            yield self.model

    def detach(self) -> nn.Module:
        return cast(Any, detach_pqlora(self.model)).unload()  # then peft's: the base as it was

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The PQ adapter in ``out_dir`` and the personal LoRA as a PEFT directory in ``out_dir/personal-lora``."""
        self.personal.save(out_dir, base_model_name)
        return super().save(out_dir, base_model_name)
