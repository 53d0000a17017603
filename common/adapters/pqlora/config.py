"""What a PQ-LoRA adapter is: rank, how many (last) transformer blocks, which projections, scaling, gate, seed.

``PQLoraSection`` is the run-config section (``pqlora.*``, validated with the run); ``PQLoraConfig`` is what is
attached to a model and saved beside its weights (the section plus the run's seed), like peft's ``LoraConfig``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from pydantic import Field, field_validator

from common.section import split_csv

from ..base import OwnStepSection


class PQLoraSection(OwnStepSection):
    """The PQ-LoRA adapter (FedMosaic): frozen orthogonal A/B, trainable r x r P and r-vector Q, per-block gates."""

    key: ClassVar[str] = "pqlora"
    per_model: ClassVar[frozenset[str]] = frozenset({"learning-rate", "gate-init", "gate-learning-rate"})
    r: int = Field(8, ge=1, le=128)
    # Adapt the last ``blocks`` transformer blocks. 24: every block of Qwen2.5-0.5B, 24 of SmolLM2-135M's 30, so
    # clients of both models share the same block indices. Chosen by a validation sweep (2026-11-23, commit 4131ac1;
    # docs/comparing.md): 4 blocks of rank 8 could not learn (BoolQ 2.55 -> 2.13 where a local LoRA gets 0.28).
    blocks: int = Field(24, ge=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    scaling: float = Field(4.0, gt=0)
    gate_init: float = 0.0  # beta = sigmoid(gate); 0.0 -> beta 0.5
    # P/Q are a few thousand numbers: they need a larger step than LoRA's. Used instead of train.learning-rate when
    # the adapter is PQ-LoRA. 3e-2 beat 1e-2 on the validation sweeps (worst client 0.557 against 0.614 with the "pq"
    # local path; SimGrad's "lora" local path is best only at 3e-2). With the "pq" path it made round 1's unaligned
    # cross-model mix raise a Qwen client's loss (tests/test_e2e_simgrad.py); with the personal LoRA (SimGrad's
    # default local path now) that test passes at 3e-2 (docs/comparing.md, "Comparing strategies").
    learning_rate: float = Field(3e-2, gt=0, le=1)
    # The gate logits' own rate (0: ``learning_rate``). At 3e-2 a gate moves by at most ~0.7 in 24 Adam steps, so
    # beta stays near its initial 0.5 (0.43-0.57 measured) and cannot shut a global path that hurts its client.
    gate_learning_rate: float = Field(0.0, ge=0, le=10)

    _csv = field_validator("target_modules", mode="before")(split_csv)

    def adapter_config(self, seed: int, trains_global: bool = False) -> PQLoraConfig:
        """What is attached to a model: these settings with the run's seed (shared A/B across the federation)."""
        return PQLoraConfig(
            trains_global=trains_global,
            r=self.r,
            num_blocks=self.blocks,
            target_modules=tuple(self.target_modules),
            scaling=self.scaling,
            gate_init=self.gate_init,
            seed=seed,
        )


@dataclass(frozen=True)
class PQLoraConfig:
    """Configuration of a FedMosaic PQ-LoRA adapter.

    Attributes:
        r: rank of the frozen orthogonal A (r x d_in) / B (d_out x r); P is r x r and Q has r entries.
        num_blocks: adapt the LAST ``num_blocks`` transformer blocks (indexed 0.. from the first adapted one).
        target_modules: names of the projections to wrap inside each adapted block (e.g. ``q_proj``).
        scaling: factor on the adapter path.
        gate_init: initial gate logit per block; beta = sigmoid(gate), 0.0 -> beta 0.5.
        seed: base seed of the deterministic A/B init (shared by every client of a federation).
        trains_global: False (the seeds' form): h = W h + (1 - beta) PQ_L h + beta PQ_G h, P_L trains, P_G is what
            the server sent. True (beside a personal LoRA, which is then the local path): h = W h + beta PQ h, one
            PQ path that starts each message from what the server sent and trains (held in P_L; P_G keeps the
            received copy to align onto).
    """

    r: int = 8
    num_blocks: int = 4
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    scaling: float = 1.0
    gate_init: float = 0.0
    seed: int = 0
    trains_global: bool = False

    def __post_init__(self) -> None:
        # Lists (JSON) and "a,b" strings (TOML run config) are normalised to a tuple so configs compare equal.
        modules = self.target_modules
        if isinstance(modules, str):
            modules = tuple(m.strip() for m in modules.split(",") if m.strip())
        try:
            modules = tuple(modules)
        except TypeError:
            raise ValueError(f"target_modules: expected a sequence of names, got {self.target_modules!r}") from None
        object.__setattr__(self, "target_modules", modules)

        if not _is_int(self.r) or self.r < 1:
            raise ValueError(f"r: must be an integer >= 1, got {self.r!r}")
        if not _is_int(self.num_blocks) or self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be an integer >= 1, got {self.num_blocks!r}")
        if not modules or not all(isinstance(m, str) and m for m in modules):
            raise ValueError(f"target_modules: must be non-empty names, got {self.target_modules!r}")
        if len(set(modules)) != len(modules):
            raise ValueError(f"target_modules: duplicate names in {modules!r}")
        if not _is_real(self.scaling) or not math.isfinite(self.scaling) or self.scaling <= 0:
            raise ValueError(f"scaling: must be a finite number > 0, got {self.scaling!r}")
        if not _is_real(self.gate_init) or not math.isfinite(self.gate_init):
            raise ValueError(f"gate_init: must be a finite number, got {self.gate_init!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed: must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.trains_global, bool):
            raise ValueError(f"trains_global: must be true or false, got {self.trains_global!r}")
        object.__setattr__(self, "scaling", float(self.scaling))
        object.__setattr__(self, "gate_init", float(self.gate_init))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``target_modules`` as a list)."""
        out = asdict(self)
        out["target_modules"] = list(self.target_modules)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PQLoraConfig:
        """Inverse of ``to_dict``; unknown keys are an error (a typo must not fall back to a default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown PQLoraConfig field (known: {sorted(known)})")
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
