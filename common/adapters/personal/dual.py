"""What makes an adapter kind dual-path: a personal LoRA beside its travelling path (``DualPath``), the glue the
dual kinds (``lora/dual.py``, ``pqlora/dual.py``, ``experts/dual.py``) share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from ..base import AdapterBase, Arrays, ClientState
from .config import PersonalSection
from .path import PERSONAL_STATE, PersonalLora

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section


class DualPath(AdapterBase):
    """A mixin that puts a personal LoRA (``personal.*``) beside the travelling path of the kind it is mixed into
    (``class LoraDualAdapter(DualPath, LoraAdapter)``): the personal LoRA trains every round at its own learning
    rate, stays in the client's ``ClientState`` (``personal.lora``, added to the kind's state keys), is saved as a
    PEFT directory beside the kind's own copy, and is never part of what is sent.

    Attributes:
        personal_under: True: the personal LoRA is attached first and the kind wraps its layers (PQ-LoRA, the expert
            pool), so switching off and detaching add peft's to the kind's own; False: it is a second peft adapter
            beside the kind's own (LoRA), which the kind's ``disabled`` and ``detach`` already cover.
        personal: the client's personal path (``PersonalLora``).
    """

    # super() below is the kind mixed in after DualPath, which implements what AdapterBase leaves abstract; mypy
    # sees AdapterBase's abstract methods there (hence the ``safe-super`` ignores)
    extra_sections: ClassVar[tuple[type[Section], ...]] = (PersonalSection,)
    personal_under: ClassVar[bool] = True
    personal: PersonalLora

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if PERSONAL_STATE not in cls.state_keys:
            cls.state_keys = (*cls.state_keys, PERSONAL_STATE)

    def attach(self, base: nn.Module, cfg: RunConfig) -> nn.Module:
        if not self.personal_under:
            model = super().attach(base, cfg)  # type: ignore[safe-super]
            self.personal = PersonalLora(model, cfg)  # peft's second adapter; ``initial`` stays the kind's own
            return model
        self.personal = PersonalLora(base, cfg)
        return super().attach(self.personal.model, cfg)  # type: ignore[safe-super]  # wraps peft's LoRA layers

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        return f"{super().settings(cfg)} personal={cfg.section(PersonalSection).model_dump_json()}"

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        super().begin(state, received)
        self.personal.begin(state)

    def prepare_training(self) -> None:
        super().prepare_training()
        self.personal.make_trainable()

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        return self.regroup(self.personal.lr_groups(self.model))

    def end(self, state: ClientState) -> None:
        super().end(state)
        self.personal.end(state)

    @contextmanager
    def disabled(self) -> Iterator[Any]:
        peft = cast(Any, self.model).disable_adapter() if self.personal_under else nullcontext()  # a PeftModel
        with super().disabled(), peft:  # type: ignore[safe-super]
            yield self.model

    def detach(self) -> nn.Module:
        base = super().detach()  # type: ignore[safe-super]
        return cast(Any, base).unload() if self.personal_under else base  # then peft's: the base as it was

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The personal LoRA as a PEFT directory in ``out_dir/personal-lora``, and the kind's own copy (if any)."""
        own = self.personal.save(out_dir, base_model_name)
        kept = super().save(out_dir, base_model_name)
        return kept if kept is not None else own
