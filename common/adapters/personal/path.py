"""The personal path a dual-path adapter kind composes: a client's own LoRA, swapped in from its ``ClientState``
each message, trained with its own learning rate, saved as a PEFT directory, and never part of what is sent."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..lora.model import save_peft_adapter
from .config import PersonalSection
from .model import add_personal_lora, get_personal_arrays, personal_parameters, set_personal_arrays

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig

PERSONAL_STATE = "personal.lora"  # the ClientState key (a kind that composes this path declares it)
EXPORT_DIR = "personal-lora"  # inside the client's adapter directory


class PersonalLora:
    """One run's personal LoRA on a shared base model; one client's weights live in its ``ClientState``.

    Attributes:
        model: the model with the ``personal`` peft adapter (what the composing kind attaches more to).
        initial: the weights every client starts from (B zero: the path starts as the identity).
        lr_scale: its learning rate as a multiple of the round's (the kind's own learning rate), so both paths
            follow the same cosine schedule across rounds.
    """

    def __init__(self, base: nn.Module, cfg: RunConfig) -> None:
        self.section = cfg.section(PersonalSection)
        self.model = add_personal_lora(base, self.section, seed=cfg.seed)
        self.initial = get_personal_arrays(self.model)
        own = self.section.learning_rate or cfg.train.learning_rate
        self.lr_scale = own / cfg.train_settings().learning_rate

    def begin(self, state) -> None:
        """Swap this client's kept personal LoRA in (the initial one the first time)."""
        kept = state.get(PERSONAL_STATE)
        set_personal_arrays(self.model, kept if kept is not None else self.initial)

    def at_start(self) -> None:
        """The initial weights (B zero: the path adds nothing), frozen: the model as it is without this path, for
        a measurement that must not depend on what the client trained (ATLAS's and MIRA's fingerprints). The
        client's kept weights are untouched; ``begin`` swaps them back in."""
        set_personal_arrays(self.model, self.initial)
        for param in self.parameters():
            param.requires_grad_(False)

    def end(self, state) -> None:
        state.put(PERSONAL_STATE, get_personal_arrays(self.model))

    def parameters(self) -> list[nn.Parameter]:
        return personal_parameters(self.model)

    def make_trainable(self) -> None:
        for param in self.parameters():
            param.requires_grad_(True)

    def lr_groups(self, model: nn.Module) -> list[tuple[list[nn.Parameter], float]]:
        """``model``'s other trainable parameters at the round's rate, the personal LoRA at ``lr_scale`` times it."""
        own = self.parameters()
        mine = {id(p) for p in own}
        return [([p for p in model.parameters() if p.requires_grad and id(p) not in mine], 1.0), (own, self.lr_scale)]

    def save(self, out_dir: Path, base_model_name: str) -> Path:
        """A PEFT directory of this client's personal LoRA (``<out_dir>/personal-lora``)."""
        return save_peft_adapter(get_personal_arrays(self.model), self.section, base_model_name, out_dir / EXPORT_DIR)
