"""LoRA with a personal LoRA beside it (``fedavg-dual``): the baseline for SimGrad's LoRA local path.

h = W h + LoRA_global(h) + LoRA_personal(h). The global LoRA (peft's ``default`` adapter, ``lora.*``) is what the
server sends and what is sent back; the personal one (``personal.*``) trains each round and stays in the client's
``ClientState``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..base import Arrays, ClientState
from ..personal import PERSONAL_STATE, PersonalLora, PersonalSection
from .adapter import LoraAdapter

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section


class LoraDualAdapter(LoraAdapter):
    """A travelling LoRA beside a personal LoRA that never leaves the client (see the module docstring)."""

    name: ClassVar[str] = "lora-dual"
    extra_sections: ClassVar[tuple[type[Section], ...]] = (PersonalSection,)
    state_keys: ClassVar[tuple[str, ...]] = (PERSONAL_STATE,)

    def __init__(self, base: nn.Module, cfg: RunConfig) -> None:
        super().__init__(base, cfg)
        self.personal = PersonalLora(self.model, cfg)  # peft's second adapter; ``initial`` stays the global one

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        return f"{super().settings(cfg)} personal={cfg.section(PersonalSection).model_dump_json()}"

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        super().begin(state, received)
        self.personal.begin(state)

    def prepare_training(self, active: list[int] | None) -> None:
        self.personal.make_trainable()

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        return self.personal.lr_groups(self.model)

    def end(self, state: ClientState) -> None:
        self.personal.end(state)

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The personal LoRA as a PEFT directory (the server saves the global one)."""
        return self.personal.save(out_dir, base_model_name)
