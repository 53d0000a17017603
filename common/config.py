"""The run configuration: every key of ``[tool.flwr.app.config]`` typed, bounded and documented.

Flower hands the ServerApp and ClientApp a flat dict (``context.run_config``) whose nested keys are joined with
dots (``train.local-steps``). ``RunConfig.from_flat`` turns that dict into validated sections and fails before
round 1 with ``ConfigError`` naming each bad key and the reason. Unknown keys are errors too: a typo must not
silently fall back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from common.core_sections import (
    DataSection,
    DPSection,
    EvalSection,
    GuardSection,
    ModelSection,
    RobustSection,
    SecAggSection,
    TrainSection,
)
from common.section import ConfigError, Section, SectionT, join_value

__all__ = [  # the config's vocabulary, importable from here as before the split into common.section / core_sections
    "ConfigError",
    "DataSection",
    "DPSection",
    "EvalSection",
    "GuardSection",
    "ModelSection",
    "Plan",
    "RobustSection",
    "RunConfig",
    "SecAggSection",
    "Section",
    "TrainSection",
    "pyproject_defaults",
    "resolve_run_dir",
]


def resolve_run_dir(run_dir: str | Path) -> Path:
    """``run-dir`` as an absolute path: relative paths resolve against ``$TESSERA_RUN_ROOT`` (set by the scripts),
    else the current directory (the ServerApp's and ClientApp's working directories are Flower's choice)."""
    path = Path(run_dir).expanduser()
    if not path.is_absolute():
        path = Path(os.environ.get("TESSERA_RUN_ROOT", os.getcwd())) / path
    return path.resolve()


class Plan(NamedTuple):
    """What a run's strategy says of its validated config (``strategies.registry.run_plan``).

    Attributes:
        adapter: the adapter kind it trains (a key of ``common.adapters.ADAPTER_KINDS``).
        adapter_section: that kind's section (its ``train_overrides`` replace local-training settings).
        checked: the sections the run reads beyond the core, whose ``check`` must pass.
        guarded_by_default: whether ``guard.enabled = "auto"`` turns the do-no-harm guard on for it.
    """

    adapter: str
    adapter_section: type[Section]
    checked: Sequence[type[Section]]
    guarded_by_default: bool = False


Planner = Callable[["RunConfig"], Plan]


def pyproject_defaults(pyproject: Path) -> dict[str, Any]:
    """The app's run config in ``pyproject.toml`` as Flower's flat keys (TOML reads ``pqlora.r = 8`` as a table)."""
    import tomllib
    from flwr.common.config import flatten_dict

    return dict(flatten_dict(tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]))


class RunConfig(Section):
    """The whole run. Top-level keys are the user-facing contract (``strategy``, ``secure``, ...).

    Besides the core sections below, every registered adapter kind and strategy has its own section
    (``lora.*``, ``pqlora.*``, ``simgrad.*``, ...), reached with ``cfg.section(SectionClass)``.
    """

    strategy: str = Field("fedavg", min_length=1)  # a name in strategies.registry
    secure: bool = False
    num_server_rounds: int = Field(3, ge=1, le=10_000)
    run_dir: str = Field("runs/latest", min_length=1)
    live_curves: bool = True  # every round's metrics also to TensorBoard under <run-dir>/tensorboard (server_app.live)
    resume: bool = False
    seed: int = 0
    min_train_replies: int = Field(2, ge=1)
    round_timeout: float = Field(3600.0, gt=0)
    node_wait_timeout: float = Field(300.0, gt=0)  # how long to wait for min-train-replies nodes to connect
    # client sampling (Flower's names): a round trains a seeded sample of int(n * fraction-train) clients, at least
    # max(min-train-nodes, min-train-replies), so a secure round always has the 3 a SecAgg+ group needs
    fraction_train: float = Field(1.0, gt=0, le=1)
    fraction_evaluate: float = Field(1.0, gt=0, le=1)  # < 1: evaluate a sample (and every client that trained)
    min_train_nodes: int = Field(0, ge=0)
    min_evaluate_nodes: int = Field(1, ge=1)
    min_available_nodes: int = Field(0, ge=0)  # nodes to wait for before round 1 (at least min-train-replies)
    evaluate_all_every: int = Field(0, ge=0)  # with fraction-evaluate < 1: every client on rounds k * this (0: never)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    secagg: SecAggSection = Field(default_factory=SecAggSection)
    robust: RobustSection = Field(default_factory=RobustSection)
    guard: GuardSection = Field(default_factory=GuardSection)
    dp: DPSection = Field(default_factory=DPSection)
    _sections: dict[str, Section] = PrivateAttr(default_factory=dict)
    _plan: Plan | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_core(self) -> RunConfig:
        if self.secure and self.min_train_replies < 3:
            # SecAgg+ over 2 clients leaks each update to the other one.
            raise ValueError("min-train-replies: must be >= 3 when secure=true (a SecAgg+ group of 2 leaks updates)")
        if self.guard.enabled is True and self.data.validation_fraction == 0:
            raise ValueError("guard.enabled: it chooses on the validation split; set data.validation-fraction > 0")
        if self.guard.enabled is True and self.data.eval_split == "validation":
            # it would choose on the very examples it reports: a flattering number, not a measurement
            raise ValueError("guard.enabled: not with data.eval-split = 'validation' (it chooses on that split)")
        self._check_dp()
        return self

    def _check_dp(self) -> None:
        """The privacy settings against the rest of the run: the mode against ``secure``, and a target the planned
        rounds can meet (``common.privacy``)."""
        if self.dp.enabled and self.dp.target_epsilon == 0 and self.dp.noise_multiplier == 0:
            raise ValueError("dp.target-epsilon: set it (or dp.noise-multiplier) when dp.mode is not 'off'")
        if self.dp.mode == "distributed" and not self.secure:
            raise ValueError(
                "dp.mode: 'distributed' adds the noise before SecAgg+ masks; it needs secure=true "
                "(in plain mode, 'central')"
            )
        if self.dp.mode == "central" and self.secure:
            raise ValueError(
                "dp.mode: 'central' has the server add the noise to sums it sees; with secure=true "
                "the members add it ('distributed')"
            )
        if self.dp.record_enabled and self.guard.enabled is True:
            raise ValueError(
                "guard.enabled: not with record-level DP (dp.record-epsilon): it chooses on the member's validation "
                "records outside the DP-SGD steps"
            )
        if not self.dp.enabled:
            return
        from common.privacy import clamp_problem, share_std
        from common.secure_bounds import MIN_SECURE_GROUP

        try:
            z = self.dp.planned_noise(self.num_server_rounds)
        except ValueError as err:
            raise ValueError(f"dp.target-epsilon: {err}") from None
        if self.dp.mode == "distributed":  # the largest share a member adds (the fewest shares) against the clamp
            share = share_std(z, self.dp.clip_norm, MIN_SECURE_GROUP)
            if problem := clamp_problem(share, self.dp.clip_norm, self.secagg.clipping_range):
                raise ValueError(problem)

    def section(self, kind: type[SectionT]) -> SectionT:
        """This run's values of an adapter's or strategy's section (its defaults when the run sets none)."""
        value = self._sections.get(kind.key)
        return value if isinstance(value, kind) else kind()

    def with_section(self, section: Section) -> RunConfig:
        """A copy of this config with one section replaced (e.g. one client's own LoRA ranks)."""
        copy = self.model_copy()
        copy._sections = {**self._sections, section.key: section}
        return copy

    @property
    def adapter(self) -> str:
        """The adapter kind this run's strategy trains (``common.adapters.ADAPTER_KINDS``), as the strategy's plan
        said when the config was built (``strategies.load_run_config``)."""
        return self._planned().adapter

    def _planned(self) -> Plan:
        if self._plan is None:
            raise ConfigError("strategy: this config was built without its strategy (use strategies.load_run_config)")
        return self._plan

    @property
    def guarded(self) -> bool:
        """Whether this run's clients run the do-no-harm guard: ``guard.enabled`` as set, or with ``auto`` (its
        default) where the strategy guards by default and nothing of the run stops it (``auto_guard_blocked``)."""
        if self.guard.enabled != "auto":
            return bool(self.guard.enabled)
        return self._plan is not None and self._plan.guarded_by_default and self.auto_guard_blocked() is None

    def auto_guard_blocked(self) -> str | None:
        """What of this run keeps ``guard.enabled = "auto"`` off, as the change that would allow it (None:
        nothing): record-level DP, no validation split, or evaluation on the validation split."""
        if self.dp.record_enabled:
            return "record-level DP (dp.record-epsilon) is on: it chooses on validation records outside DP-SGD"
        if self.data.validation_fraction == 0:
            return "no validation split to choose on: set data.validation-fraction > 0 (e.g. 0.2)"
        if self.data.eval_split != "test":
            return "evaluation reports the validation split (data.eval-split): it would choose on what it reports"
        return None

    def unguarded_why(self) -> str | None:
        """Why ``guard.enabled = "auto"`` left off the guard this run's strategy would have by default (None: it is
        on, asked off, or the strategy has none): what the operator changes to have it."""
        if self.guard.enabled != "auto" or self._plan is None or not self._plan.guarded_by_default:
            return None
        return self.auto_guard_blocked()

    def train_settings(self) -> TrainSection:
        """The local-training settings for this run's adapter (e.g. PQ-LoRA has its own learning rate)."""
        overrides = self.section(self._planned().adapter_section).train_overrides()
        return self.train.model_copy(update=overrides) if overrides else self.train

    def run_path(self) -> Path:
        return resolve_run_dir(self.run_dir)

    def for_model(self, name: str) -> RunConfig:
        """This config as a client that loads base model ``name`` reads it: ``model.overrides`` for ``name`` applied,
        each section validated with its new values and the run's cross-section checks rerun (``common.per_model``).
        The server reads the run's values."""
        from common.per_model import overridden, overrides_of

        result = self
        for head, values in overrides_of(self.model.overrides, name).items():
            if head == "train":
                result = result.model_copy(update={"train": overridden(self.train, head, values, name)})
            elif head in self._sections:  # validated with the run, read or not by its strategy (as its own keys)
                result = result.with_section(overridden(self._sections[head], head, values, name))
            else:
                raise ValueError(f"model.overrides: {name}: '{head}' is not a section with per-model keys")
        if result is not self:
            try:
                for kind in result._planned().checked:
                    result.section(kind).check(result)
            except ValueError as err:
                raise ValueError(f"model.overrides: {name}: {err}") from None
        return result

    def model_for_partition(self, partition_id: int) -> str:
        """The base model of a partition when its node sets none: ``model.partition-models`` cycled, else
        ``model.name``."""
        models = self.model.partition_models
        return models[partition_id % len(models)] if models else self.model.name

    @classmethod
    def from_flat(
        cls, flat: Mapping[str, Any], sections: Mapping[str, type[Section]] | None = None, plan: Planner | None = None
    ) -> RunConfig:
        """Build from Flower's flattened run config (``{"train.local-steps": 8, ...}``); see ``from_nested``."""
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            head, _, tail = key.partition(".")
            if tail:
                section = nested.setdefault(head, {})
                if not isinstance(section, dict):
                    raise ConfigError(f"{head}: is both a value and a section")
                section[tail] = value
            else:
                nested[key] = value
        return cls.from_nested(nested, sections, plan)

    @classmethod
    def from_nested(
        cls, nested: Mapping[str, Any], sections: Mapping[str, type[Section]] | None = None, plan: Planner | None = None
    ) -> RunConfig:
        """Validate the core keys and the given ``sections`` (key -> class: the adapter kinds' and strategies'; a key
        of none of them is an error); then ``plan`` names the run's adapter kind and the sections whose ``check``
        must pass. The strategy registry supplies both (``strategies.load_run_config``): this layer knows no
        strategy."""
        nested = dict(nested)
        errors: list[Mapping[str, Any]] = []
        validated: dict[str, Section] = {}
        for key, kind in (sections or {}).items():
            try:
                validated[key] = kind.model_validate(nested.pop(key, {}))
            except ValidationError as err:
                errors += [{**item, "loc": (key, *item["loc"])} for item in err.errors()]
        try:
            cfg = cls.model_validate(nested)
        except ValidationError as err:
            errors = list(err.errors()) + errors
        if errors:
            raise ConfigError(_describe(errors))
        cfg._sections = validated
        if plan is None:
            return cfg
        try:
            cfg._plan = plan(cfg)
            for kind in cfg._plan.checked:
                cfg.section(kind).check(cfg)
        except ValueError as err:
            raise ConfigError(_describe([{"msg": str(err), "loc": (), "type": "value_error"}])) from None
        from common.per_model import split_target

        try:  # every named model's values checked once, before round 1, not on its first client
            for name in dict.fromkeys(split_target(target)[0] for target in cfg.model.overrides):
                cfg.for_model(name)
        except ValueError as err:
            raise ConfigError(_describe([{"msg": str(err), "loc": (), "type": "value_error"}])) from None
        return cfg

    def to_flat(self) -> dict[str, Any]:
        """The inverse of ``from_flat`` (lists joined by commas), e.g. to send to clients or to log."""
        dumped = self.model_dump(by_alias=True)
        dumped.update({key: section.model_dump(by_alias=True) for key, section in self._sections.items()})
        flat: dict[str, Any] = {}
        for key, value in dumped.items():
            if isinstance(value, dict):
                for sub, subval in value.items():
                    flat[f"{key}.{sub}"] = join_value(subval)
            else:
                flat[key] = value
        return flat


def _describe(errors: list[Any]) -> str:
    lines = []
    for item in errors:
        reason = item["msg"].removeprefix("Value error, ")
        key = ".".join(str(part) for part in item["loc"])
        # a cross-field check names its key at the start of its message (inside a section: a key of that section)
        if not key or (reason.startswith(f"{key}.") and ": " in reason):
            key, _, reason = reason.partition(": ")
        if item["type"] == "extra_forbidden":
            reason = "unknown key (check the spelling against pyproject.toml)"
        got = item.get("input")
        suffix = (
            "" if item["type"] in ("extra_forbidden", "value_error") or isinstance(got, dict) else f" (got {got!r})"
        )
        lines.append(f"{key}: {reason}{suffix}")
    return "invalid run config:\n  " + "\n  ".join(lines)
