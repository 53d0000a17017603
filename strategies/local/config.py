"""The local-only baseline's run-config section (``local.*``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from common.section import Section


class LocalSection(Section):
    """Local-only training: which adapter kind each client trains on its own.

    adapter: ``lora`` (compare with FedAvg), ``pqlora`` (compare with SimGrad: the same adapter, never mixed) or
    ``sublora`` (compare with FedAvg of SubLoRA).
    """

    key: ClassVar[str] = "local"
    adapter: Literal["lora", "pqlora", "sublora"] = "lora"
