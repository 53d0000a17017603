"""The local-only baseline's run-config section (``local.*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pydantic import field_validator

from common.adapters import kind_that_fits
from common.section import Section

if TYPE_CHECKING:
    from common.adapters import AdapterKind


class LocalSection(Section):
    """Local-only training: which adapter kind each client trains on its own.

    adapter: a single-path kind that either keeps the client's whole adapter itself or keeps nothing (the local
    client keeps its arrays): ``lora`` (compare with FedAvg), ``pqlora`` (compare with SimGrad: the same adapter,
    never mixed) or ``sublora`` (compare with FedAvg of SubLoRA).
    """

    key: ClassVar[str] = "local"
    adapter: str = "lora"

    @field_validator("adapter")
    @classmethod
    def _trained_alone(cls, name: str) -> str:
        return kind_that_fits(name, trained_alone, "that a client trains alone")


def trained_alone(kind: type[AdapterKind]) -> bool:
    """Whether local-only can train ``kind``: one path (no personal LoRA beside it), kept whole by the kind or not
    at all (the expert pool keeps only its routers: it needs VEMoE to send and route its experts)."""
    return not kind.extra_sections and (kind.keeps_adapter or not kind.state_keys)
