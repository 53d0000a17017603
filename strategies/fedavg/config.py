"""FedAvg's run-config section (``fedavg.*``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import field_validator

from common.adapters import kind_that_fits
from common.section import Section


class FedAvgSection(Section):
    """FedAvg: which adapter kind the clients train and the server averages.

    adapter: a kind whose whole adapter travels (it keeps nothing on the client): ``lora`` (peft LoRA, every A and
    B travels) or ``sublora`` (LoRA in a random subspace: only its ``sublora.intrinsic-dim`` numbers travel, and
    averaging them is averaging the LoRA they define).
    """

    key: ClassVar[str] = "fedavg"
    adapter: str = "lora"

    @field_validator("adapter")
    @classmethod
    def _averaged_whole(cls, name: str) -> str:
        return kind_that_fits(name, lambda kind: not kind.state_keys, "that FedAvg averages whole")
