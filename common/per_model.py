"""Settings per base model (``model.overrides``): what a client that loads one model trains with.

In a federation of several base models a step size tuned on one need not suit another (PQ-LoRA's 3e-2 was chosen on
SmolLM2 clients). ``model.overrides = "qwen2.5-coder-0.5b-instruct:pqlora.learning-rate=0.01"`` gives that model's
clients their own value (``RunConfig.for_model``). Only the keys a section lists in ``Section.per_model`` may differ:
client-side step sizes and the like, never a shape the federation shares (ranks, blocks) or a value the server reads
(steps, batch size). Pure helpers on pydantic models: this module imports nothing of the config it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


def split_target(target: str) -> tuple[str, str, str]:
    """``"model:section.key"`` -> (model, section, key); the model is everything before the last colon."""
    model, _, key = target.rpartition(":")
    head, _, tail = key.partition(".")
    if not model or not head or not tail:
        raise ValueError(f"expected 'model:section.key=value' pairs, got {target!r}")
    return model, head, tail


def overrides_of(overrides: Mapping[str, str], name: str) -> dict[str, dict[str, str]]:
    """Base model ``name``'s overrides as ``section -> {key: value}`` (empty: it trains with the run's values)."""
    found: dict[str, dict[str, str]] = {}
    for target, value in overrides.items():
        model, head, tail = split_target(target)
        if model == name:
            found.setdefault(head, {})[tail] = value
    return found


def overridden(current: ModelT, head: str, values: Mapping[str, str], name: str) -> ModelT:
    """Section ``current`` (run-config prefix ``head``) with ``values`` on top, validated by its own class; a
    ValueError naming the key when one is not in its ``per_model`` or its value is refused."""
    allowed: frozenset[str] = getattr(current, "per_model", frozenset())
    refused = sorted(set(values) - allowed)
    if refused:
        listed = ", ".join(f"{head}.{key}" for key in sorted(allowed)) or "none"
        raise ValueError(
            f"model.overrides: {name}: {', '.join(f'{head}.{key}' for key in refused)} cannot differ by base model "
            f"(a shape the federation shares or a value the server reads); the per-model keys of '{head}': {listed}"
        )
    try:
        return type(current).model_validate({**current.model_dump(by_alias=True), **values})
    except ValidationError as err:
        problems = "; ".join(
            f"{head}.{'.'.join(str(part) for part in item['loc'])}: {item['msg']} (got {item.get('input')!r})"
            for item in err.errors()
        )
        raise ValueError(f"model.overrides: {name}: {problems}") from None
