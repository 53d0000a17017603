"""Settings per base model (``model.overrides``): what a client that loads one model trains with.

In a federation of several base models a step size tuned on one need not suit another (PQ-LoRA's 3e-2 was chosen on
SmolLM2 clients). ``model.overrides = "qwen2.5-coder-0.5b-instruct:pqlora.learning-rate=0.01"`` gives that model's
clients their own value. Only the keys a section lists in ``Section.per_model`` may differ: client-side step sizes
and the like, never a shape the federation shares (ranks, blocks) or a value the server reads (steps, batch size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from common.config import RunConfig, Section


def split_target(target: str) -> tuple[str, str, str]:
    """``"model:section.key"`` -> (model, section, key); the model is everything before the last colon."""
    model, _, key = target.rpartition(":")
    head, _, tail = key.partition(".")
    if not model or not head or not tail:
        raise ValueError(f"expected 'model:section.key=value' pairs, got {target!r}")
    return model, head, tail


def overrides_of(cfg: RunConfig, name: str) -> dict[str, dict[str, str]]:
    """Base model ``name``'s overrides as ``section -> {key: value}`` (empty: it trains with the run's values)."""
    found: dict[str, dict[str, str]] = {}
    for target, value in cfg.model.overrides.items():
        model, head, tail = split_target(target)
        if model == name:
            found.setdefault(head, {})[tail] = value
    return found


def _overridden(current: Section, head: str, values: dict[str, str], name: str) -> Section:
    """``current`` with ``values`` on top, validated; ValueError naming the key when one may not differ or is bad."""
    refused = sorted(set(values) - current.per_model)
    if refused:
        allowed = ", ".join(f"{head}.{key}" for key in sorted(current.per_model)) or "none"
        raise ValueError(
            f"model.overrides: {name}: {', '.join(f'{head}.{key}' for key in refused)} cannot differ by base model "
            f"(a shape the federation shares or a value the server reads); the per-model keys of '{head}': {allowed}"
        )
    try:
        return type(current).model_validate({**current.model_dump(by_alias=True), **values})
    except ValidationError as err:
        problems = "; ".join(
            f"{head}.{'.'.join(str(part) for part in item['loc'])}: {item['msg']} (got {item.get('input')!r})"
            for item in err.errors()
        )
        raise ValueError(f"model.overrides: {name}: {problems}") from None


def apply_model_overrides(cfg: RunConfig, name: str) -> RunConfig:
    """``cfg`` as a client of base model ``name`` reads it: each overridden section validated with its new values,
    then the run's cross-section checks (``Section.check``) rerun on the result."""
    overrides = overrides_of(cfg, name)
    if not overrides:
        return cfg
    result = cfg
    for head, values in overrides.items():
        if head == "train":
            result = result.model_copy(update={"train": _overridden(cfg.train, head, values, name)})
            continue
        # like any key, an override of a section this run's strategy does not read is validated and then unused
        current = cfg.section_named(head)
        if current is None:
            raise ValueError(f"model.overrides: {name}: '{head}' is not a section with per-model keys")
        result = result.with_section(_overridden(current, head, values, name))
    try:
        for kind in result._planned().checked:
            result.section(kind).check(result)
    except ValueError as err:
        raise ValueError(f"model.overrides: {name}: {err}") from None
    return result
