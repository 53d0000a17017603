"""What a personal LoRA is: the run-config section ``personal.*`` (a LoRA section with its own learning rate)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from ..lora.config import LoraSection


class PersonalSection(LoraSection):
    """The personal LoRA of the dual-path kinds (``fedavg-dual``; ``simgrad`` with ``simgrad.local-path="lora"``).

    Rank, alpha, dropout and target modules as ``lora.*`` (same defaults), on every block. ``learning-rate``: its
    own step size (0: ``train.learning-rate``), on the same cosine schedule across rounds as the travelling path.
    """

    key: ClassVar[str] = "personal"
    per_model: ClassVar[frozenset[str]] = frozenset({"learning-rate"})
    learning_rate: float = Field(0.0, ge=0, le=1)
