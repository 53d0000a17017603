"""The expert pool with a personal LoRA beside it (VEMoE with ``vemoe.personal-lora = true``).

h = W h + LoRA_personal(h) + sum_k alpha_tk expert_k(h): the personal LoRA (``personal.*``) trains every round and
stays in the client's ``ClientState``; the pool is what travels, with the same wire names as the plain pool (the
server cannot tell the two apart). Why: with the pool alone, each expert is a responsibility-weighted average over
clients of several tasks, which is at least as much mixing as FedAvg (docs/strategies/vemoe.md); a personal path
keeps what is the client's own out of the experts, as fedavg-dual's does for FedAvg.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from ..base import Arrays, ClientState
from ..personal import PERSONAL_STATE, PersonalLora, PersonalSection
from .adapter import ExpertsAdapter
from .model import detach_experts, experts_disabled

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section


class ExpertsDualAdapter(ExpertsAdapter):
    """A travelling pool of LoRA experts beside a personal LoRA that never leaves the client (module docstring)."""

    name: ClassVar[str] = "experts-dual"
    extra_sections: ClassVar[tuple[type[Section], ...]] = (PersonalSection,)
    state_keys: ClassVar[tuple[str, ...]] = (*ExpertsAdapter.state_keys, PERSONAL_STATE)

    def __init__(self, base: nn.Module, cfg: RunConfig) -> None:
        self.personal = PersonalLora(base, cfg)
        super().__init__(self.personal.model, cfg)  # the experts wrap peft's LoRA layers

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        return f"{super().settings(cfg)} personal={cfg.section(PersonalSection).model_dump_json()}"

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        super().begin(state, received)
        self.personal.begin(state)

    def prepare_training(self, active: list[int] | None) -> None:
        super().prepare_training(active)
        self.personal.make_trainable()

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        return self.personal.lr_groups(self.model)

    def end(self, state: ClientState) -> None:
        super().end(state)
        self.personal.end(state)

    @contextmanager
    def disabled(self) -> Iterator[Any]:
        with experts_disabled(self.model), cast(Any, self.model).disable_adapter():  # a PeftModel
            yield self.model

    def detach(self) -> nn.Module:
        return cast(Any, detach_experts(self.model)).unload()  # then peft's: the base as it was

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The routers in ``out_dir`` and the personal LoRA as a PEFT directory in ``out_dir/personal-lora``."""
        self.personal.save(out_dir, base_model_name)
        return super().save(out_dir, base_model_name)
