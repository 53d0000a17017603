"""FedAvg's run-config section (``fedavg.*``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from common.section import Section


class FedAvgSection(Section):
    """FedAvg: which adapter kind the clients train and the server averages.

    adapter: ``lora`` (peft LoRA, every A and B travels) or ``sublora`` (LoRA in a random subspace: only its
    ``sublora.intrinsic-dim`` numbers travel, and averaging them is averaging the LoRA they define).
    """

    key: ClassVar[str] = "fedavg"
    adapter: Literal["lora", "sublora"] = "lora"
