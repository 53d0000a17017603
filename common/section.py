"""The base of every run-config section, and how list and mapping values are written in a flat run config.

A section is one dotted prefix of ``[tool.flwr.app.config]`` (``train.*``, ``pqlora.*``, ``simgrad.*``, ...): the core
sections (``common.core_sections``), each adapter kind's and each strategy's. ``common.config.RunConfig`` validates
them together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

if TYPE_CHECKING:
    from common.config import RunConfig


class ConfigError(ValueError):
    """An invalid run configuration; the message names every offending key."""


class Section(BaseModel):
    """A run-config section: kebab-case keys, unknown keys refused.

    The core sections are fields of ``RunConfig``; adapter kinds (``common.adapters``) and strategies
    (``strategies.registry``) bring their own section, named by ``key``, which ``RunConfig`` validates with the rest.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=lambda s: s.replace("_", "-"))
    key: ClassVar[str] = ""
    # The keys (kebab-case) that may differ by base model (``model.overrides``): client-side step sizes and the like,
    # never a shape the federation shares or a value the server reads.
    per_model: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="before")
    @classmethod
    def _true_or_false(cls, value: Any, info: ValidationInfo) -> Any:
        """A yes/no key is true or false (pydantic's lax mode would read 'yes', 'off', 1 or 0 as one)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None or field.annotation is not bool:
            return value
        if (flag := true_or_false(value)) is None:
            raise ValueError(f"expected true or false (got {value!r})")
        return flag

    def check(self, cfg: RunConfig) -> None:
        """Checks across sections, run when this section's strategy or adapter is the run's. Raise ValueError
        with a message that starts with the key it is about (``"simgrad.route-budget: ..."``)."""

    def train_overrides(self) -> dict[str, Any]:
        """Local-training settings this adapter kind replaces (e.g. its own learning rate); none by default."""
        return {}


SectionT = TypeVar("SectionT", bound=Section)


def true_or_false(value: Any) -> bool | None:
    """A yes/no setting as written in a run or node config: a bool, or the words true / false in any case and
    spacing; None for anything else (the caller names its key)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def split_csv(value: Any) -> Any:
    """Lists in a run config may be written "a, b, c" (TOML run configs have no lists)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def split_pairs(value: Any) -> Any:
    """Mappings in a run config may be written "a=1, b=2" (TOML run configs have no tables of their own)."""
    if isinstance(value, str):
        pairs = [item.strip() for item in value.split(",") if item.strip()]
        if any("=" not in pair for pair in pairs):
            raise ValueError(f"expected 'name=value' pairs separated by commas, got {value!r}")
        return {k.strip(): v.strip() for k, v in (pair.split("=", 1) for pair in pairs)}
    return value


def join_value(value: Any) -> Any:
    """The inverse of ``split_csv`` / ``split_pairs`` for a flat run config."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return value
