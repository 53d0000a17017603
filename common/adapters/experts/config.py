"""What a pool of LoRA experts is (VEMoE, seed 002): how many slots, each expert's rank and scale, where it attaches,
and how a client's tokens are routed between its experts.

``ExpertsSection`` is the run-config section (``experts.*``). Which slots hold an expert, and each client's
responsibilities, are decided per round by the strategy (``strategies/vemoe``), not here.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from common.section import Section, split_csv


class ExpertsSection(Section):
    """A pool of ``k-max`` LoRA experts on every block's ``target-modules``, mixed per token inside a client's
    ``top-m`` experts: alpha_tk = softmax_k(log r_k + u_tk / gamma), u from a router on the layer's input."""

    key: ClassVar[str] = "experts"
    k_max: int = Field(8, ge=1, le=64)  # expert slots; every payload carries all of them (one SecAgg+ shape)
    r: int = Field(4, ge=1, le=256)  # each expert's LoRA rank
    alpha: float = Field(8.0, gt=0, allow_inf_nan=False)  # scale alpha / r, as peft's
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    top_m: int = Field(2, ge=1)  # experts a client trains and routes its tokens between
    gamma: float = Field(1.0, gt=0, allow_inf_nan=False)  # router temperature: large = every token gets r

    _csv = field_validator("target_modules", mode="before")(split_csv)

    @model_validator(mode="after")
    def _top_m_fits(self) -> ExpertsSection:
        if self.top_m > self.k_max:
            raise ValueError(f"experts.top-m: {self.top_m} exceeds experts.k-max={self.k_max}")
        return self

    @property
    def scaling(self) -> float:
        return self.alpha / self.r
