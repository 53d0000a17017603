"""The LoRA adapter kind on a shared base model: the server's adapter replaces the client's every message; all of
it trains and travels; nothing is kept between messages."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from ..base import AdapterBase, Arrays
from .config import LoraSection
from .model import attach_lora, detach_lora, get_adapter_arrays, save_peft_adapter, set_adapter_arrays
from .ranks import ranks

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section


class LoraAdapter(AdapterBase):
    """peft LoRA (FedAvg's adapter). Its arrays use peft's state-dict names, so the server saves PEFT directories."""

    name: ClassVar[str] = "lora"
    section: ClassVar[type[Section]] = LoraSection
    missing: ClassVar[str] = "LoRA keeps nothing between messages: the server (or the strategy) must give the adapter"

    def attach(self, base: nn.Module, cfg: RunConfig) -> nn.Module:
        return attach_lora(base, cfg.section(LoraSection), seed=cfg.seed)

    def arrays(self) -> Arrays:
        return get_adapter_arrays(self.model)

    def load(self, arrays: Arrays) -> None:
        set_adapter_arrays(self.model, arrays)

    def disabled(self) -> AbstractContextManager[Any]:
        return cast(Any, self.model).disable_adapter()  # a PeftModel

    def detach(self) -> nn.Module:
        return detach_lora(self.model)

    @staticmethod
    def save_server_copy(arrays: Arrays, cfg: RunConfig, base_model_name: str, out_dir: Path) -> Path:
        """A PEFT directory; layers whose rank differs from ``lora.r`` (ATLAS's per-client ranks) are written into
        its ``rank_pattern``, so ``PeftModel.from_pretrained`` rebuilds the same shapes."""
        lora = cfg.section(LoraSection)
        pattern = {path: r for path, r in ranks(arrays).items() if r != lora.r}
        return save_peft_adapter(arrays, lora.model_copy(update={"rank_pattern": pattern}), base_model_name, out_dir)
