"""What a LoRA adapter is: its run-config section (``lora.*``), turned into peft's ``LoraConfig`` by ``model.py``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from common.section import Section, split_csv, split_pairs


class LoraSection(Section):
    """The LoRA adapter every client trains (peft)."""

    key: ClassVar[str] = "lora"
    r: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    # Per-layer ranks (peft's rank_pattern): "model.layers.29.self_attn.q_proj=16,..." (a module path, or a regex
    # matching the end of one); other layers use r. Every layer keeps the scale alpha / r (peft's alpha_pattern), so
    # adapters of different ranks add up alike (ATLAS sets this per client from its memory budget).
    rank_pattern: dict[str, int] = Field(default_factory=dict)

    _csv = field_validator("target_modules", mode="before")(split_csv)
    _pairs = field_validator("rank_pattern", mode="before")(split_pairs)

    @field_validator("rank_pattern")
    @classmethod
    def _ranks(cls, value: dict[str, int]) -> dict[str, int]:
        bad = {k: r for k, r in value.items() if not 1 <= r <= 256}
        if bad:
            raise ValueError(f"ranks must be 1..256, got {bad}")
        return value

    def peft_patterns(self) -> tuple[dict[str, int], dict[str, float]]:
        """(rank_pattern, alpha_pattern) for peft: each named layer's rank, and the alpha that keeps alpha / r."""
        return dict(self.rank_pattern), {k: self.alpha * r / self.r for k, r in self.rank_pattern.items()}
