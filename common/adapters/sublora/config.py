"""What a SubLoRA adapter is (seed 004): a LoRA adapter whose A and B live in a random d-dimensional subspace,
theta = theta_0 + P alpha, and how its generalisation bound is computed.

``SubLoraSection`` is the run-config section (``sublora.*``). The LoRA shape (``r``, ``lora-alpha``,
``target-modules``) is what ``PeftModel.from_pretrained`` gets when the adapter is exported; ``intrinsic-dim``,
``projection``, ``allocation`` and ``seed`` define P, which every client builds from the seed and never sends.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from common.section import split_csv

from ..base import OwnStepSection


class SubLoraSection(OwnStepSection):
    """SubLoRA: LoRA (rank ``r`` on ``target-modules``) trained only through ``intrinsic-dim`` numbers alpha.

    allocation: ``uniform`` (one projection for A and B), ``fixed`` (``allocation-ratio`` = d_B / d, separate
    projections), ``learned`` (a gate per transformer block splits its coordinates between A and B, trained).
    projection: ``fastfood`` (O(D) memory, any model size) or ``dense`` (a D x d matrix: small adapters only).
    """

    key: ClassVar[str] = "sublora"
    per_model: ClassVar[frozenset[str]] = frozenset({"learning-rate", "gate-learning-rate"})
    intrinsic_dim: int = Field(1000, ge=2, le=1_000_000)  # d: the numbers a client trains and sends
    r: int = Field(8, ge=1, le=256)
    lora_alpha: float = Field(16.0, gt=0, allow_inf_nan=False)  # LoRA scale lora-alpha / r, as peft's
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    projection: Literal["fastfood", "dense"] = "fastfood"
    allocation: Literal["uniform", "fixed", "learned"] = "uniform"
    allocation_ratio: float = Field(0.5, gt=0, lt=1)  # fixed mode: d_B / d
    seed: int = Field(0, ge=0)  # theta_0 and P: the same on every client, so only alpha travels
    # alpha's step (used instead of train.learning-rate when the adapter is SubLoRA): a column of P has norm ~1, so
    # a step of size s on every coordinate moves theta by ~s sqrt(d); LoRA's 1e-3 on all of its D numbers moves
    # theta by ~1e-3 sqrt(D), about s = 0.02 at d = 1,000 for SmolLM2. Pilot (the demo's 3 clients, 2 rounds x 4
    # steps, d = 1,000, 16 held-out examples): 0.03 lowered every client's loss (2.60 -> 2.44, 2.60 -> 1.79,
    # 3.45 -> 3.40), 0.01 less (BoolQ 2.60 -> 2.29, XSum 3.45 -> 3.43).
    learning_rate: float = Field(3e-2, gt=0, le=10)
    # learned mode: the gates' own step (0: alpha's). A gate moves only through its share of alpha's gradient,
    # squashed by the mask's sigmoid: at alpha's step the Pareto bench's gates stayed within 0.48-0.53 in 12 steps.
    gate_learning_rate: float = Field(0.0, ge=0, le=100)
    # The bound (computed on each client's training data at the end): alpha quantised to ``quant-levels`` values by
    # k-means, arithmetic-coded; ``bound-delta`` is the bound's failure probability; predictions are smoothed with
    # the uniform distribution by ``bound-smoothing`` so that the log-loss is bounded (log2(V / smoothing) bits).
    quant_levels: int = Field(16, ge=2, le=256)
    # The first this-many training examples are the bound's sample (0: all). Occam's bound holds for every alpha at
    # once on any i.i.d. sample fixed before training, so a prefix of the training data is a valid sample; a larger
    # one tightens the bound and costs two forward passes over it at the last round.
    bound_examples: int = Field(64, ge=0)
    bound_delta: float = Field(0.05, gt=0, lt=1)
    bound_smoothing: float = Field(0.1, gt=0, lt=1)

    _csv = field_validator("target_modules", mode="before")(split_csv)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r
