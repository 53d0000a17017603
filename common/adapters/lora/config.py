"""What a LoRA adapter is: its run-config section (``lora.*``), turned into peft's ``LoraConfig`` by ``model.py``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from common.config import Section, split_csv


class LoraSection(Section):
    """The LoRA adapter every client trains (peft)."""

    key: ClassVar[str] = "lora"
    r: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)

    _csv = field_validator("target_modules", mode="before")(split_csv)
