"""The LoRA adapter kind on a shared base model: the server's adapter replaces the client's every message; all of
it trains and travels; nothing is kept between messages."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..base import Arrays, ClientState
from .config import LoraSection
from .model import attach_lora, detach_lora, get_adapter_arrays, save_peft_adapter, set_adapter_arrays
from .ranks import ranks

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section


class LoraAdapter:
    """peft LoRA (FedAvg's adapter). Its arrays use peft's state-dict names, so the server saves PEFT directories."""

    name: ClassVar[str] = "lora"
    section: ClassVar[type[Section]] = LoraSection
    extra_sections: ClassVar[tuple[type[Section], ...]] = ()
    reply_metrics: ClassVar[dict[str, type | None]] = {}
    state_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, base: nn.Module, cfg: RunConfig) -> None:
        self.model = attach_lora(base, cfg.section(LoraSection), seed=cfg.seed)
        self.initial = get_adapter_arrays(self.model)
        self._received: Arrays = self.initial

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        return f"{cfg.section(LoraSection).model_dump_json()} seed={cfg.seed}"

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        if received is None:  # the shared model holds whichever client ran last: never train from that
            raise ValueError("LoRA keeps nothing between messages: the server (or the strategy) must give the adapter")
        set_adapter_arrays(self.model, received)
        self._received = received

    def prepare_training(self, active: list[int] | None) -> None:
        """LoRA has no routing: every weight trains."""

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        return None

    def outgoing(self, active: list[int] | None) -> tuple[Arrays, dict[str, Any]]:
        return get_adapter_arrays(self.model), {}

    def received(self, active: list[int] | None) -> Arrays:
        return self._received

    def end(self, state: ClientState) -> None:
        """Nothing client-local to keep."""

    def disabled(self) -> AbstractContextManager[Any]:
        return self.model.disable_adapter()

    def detach(self) -> nn.Module:
        return detach_lora(self.model)

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The server's copy is the whole adapter (``save_server_copy``)."""
        return None

    @staticmethod
    def save_server_copy(arrays: Arrays, cfg: RunConfig, base_model_name: str, out_dir: Path) -> Path:
        """A PEFT directory; layers whose rank differs from ``lora.r`` (ATLAS's per-client ranks) are written into
        its ``rank_pattern``, so ``PeftModel.from_pretrained`` rebuilds the same shapes."""
        lora = cfg.section(LoraSection)
        pattern = {path: r for path, r in ranks(arrays).items() if r != lora.r}
        return save_peft_adapter(arrays, lora.model_copy(update={"rank_pattern": pattern}), base_model_name, out_dir)
