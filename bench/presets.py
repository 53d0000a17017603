"""Named comparison scenarios: each a client count, a round budget and a few run-config overrides.

Every preset keeps a validation split (``data.validation-fraction``) so that settings are tuned on it
(``data.eval-split='validation'``) and reported on the test split with the same training examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.assets import QWEN_CODER_ALIAS, SMOLLM2_ALIAS

Value = str | int | float | bool


@dataclass(frozen=True)
class Preset:
    """A comparison scenario.

    Attributes:
        name: what ``--preset`` calls it.
        about: what it tests and what to expect.
        clients: simulated clients (partition i of ``clients``).
        rounds: server rounds.
        overrides: run-config values (``key -> value``) on top of pyproject.toml's.
        primary: the claims this preset is run to test, declared before any run: ``statistic`` (``worst client``
            or ``mean client``) of every strategy that is not a reference against each of ``references``; the
            report Holm-corrects their verdicts and calls everything else exploratory (``bench.verdicts``).
    """

    name: str
    about: str
    clients: int
    rounds: int
    overrides: dict[str, Value] = field(default_factory=dict)
    primary: dict[str, Any] = field(
        default_factory=lambda: {"statistic": "worst client", "references": ["local", "fedavg"]}
    )


# The budget every preset shares: 8 local steps of 2 examples per round, cosine-decayed over the rounds. Evaluation
# reads 8 held-out examples per client and generates up to 12 tokens (EM and ROUGE-L).
_BUDGET: dict[str, Value] = {
    # One numeric path on every CPU: evaluation in fp32 (the packed bf16 kernel of AVX512-BF16 CPUs moved a client's
    # loss by up to 0.07 against machines without it, as large as the effects compared).
    "model.cpu-packed-inference": False,
    "train.local-steps": 8,
    "eval.max-examples": 8,
    "eval.max-new-tokens": 12,
    "data.validation-fraction": 0.2,
    "min-train-replies": 2,
}

# The first presets' budget: the shared one, with the loss on 64 held-out examples (or the client's whole test split
# where it is smaller) at round 0 and the last round, where the verdicts are made. (Its own dict: the few-shot
# presets' run configs keep their key order, which published reports are merged on.)
_PLENTY: dict[str, Value] = {**_BUDGET, "eval.final-examples": 64}

# The few-shot split: with two clients a task, 200 examples a client, 32 % test, 47 % of the rest validation: 64 test
# and 64 validation examples a client, whatever few it trains on (data.max-train-examples).
_FEW_SHOT_SPLIT: dict[str, Value] = {
    "data.max-examples-per-task": 400,
    "data.test-fraction": 0.32,
    "data.validation-fraction": 0.47,
}

# The few-shot budget: few TRAINING examples per client (data.max-train-examples), the few-shot split, the loss
# measured on all 64 held-out examples at round 0 and at the end and on 8 in the rounds between (the curves),
# generation on 8.
_FEW_SHOT: dict[str, Value] = {
    **_BUDGET,
    "train.local-steps": 6,
    "data.partitioning": "by-task",
    "data.tasks": "asdiv,boolq,xsum,commonsenseqa",
    **_FEW_SHOT_SPLIT,
    "data.max-train-examples": 24,
    "eval.final-examples": 64,
    "eval.generate-examples": 8,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tasks-distinct",
            "4 clients, one task family each (math word problems, reading QA, summarisation, commonsense QA): "
            "nothing to share, so averaging everyone's adapter can hurt (negative transfer for FedAvg).",
            clients=4,
            rounds=3,
            overrides={**_PLENTY, "data.tasks": "asdiv,boolq,xsum,commonsenseqa", "data.partitioning": "by-task"},
        ),
        Preset(
            "tasks-shared-few-shot",
            "4 clients, two per task (BoolQ, CommonsenseQA), 40 training examples per client, 64 held-out: alone "
            "each overfits its few examples; its task partner should help.",
            clients=4,
            rounds=3,
            # Until 2026-11-27: 80 examples a task and a quarter held out, so 10 test examples a client, too few for
            # any interval to resolve (every verdict of a 7-strategy run was "not resolved"). Now the few-shot
            # presets' split: the same 40 training examples a client, 64 test and 64 validation ones.
            overrides={
                **_PLENTY,
                "data.tasks": "boolq,commonsenseqa",
                "data.partitioning": "by-task",
                **_FEW_SHOT_SPLIT,
                "data.max-train-examples": 40,
            },
        ),
        Preset(
            "models-mixed",
            f"4 clients, {SMOLLM2_ALIAS} and {QWEN_CODER_ALIAS}, each task (BoolQ, CommonsenseQA) on one client of "
            "each model: FedAvg can only average within a model family (across tasks); SimGrad can share across "
            "models within a task.",
            clients=4,
            rounds=3,
            overrides={
                **_PLENTY,
                "data.tasks": "boolq,commonsenseqa",
                "data.partitioning": "by-task",
                "model.partition-models": f"{SMOLLM2_ALIAS},{SMOLLM2_ALIAS},{QWEN_CODER_ALIAS},{QWEN_CODER_ALIAS}",
            },
        ),
        Preset(
            "tasks-clustered",
            "6 clients, three per task (BoolQ, ASDiv): two true clusters of three, so each can be one SecAgg+ group. "
            "ATLAS should find them from fingerprints (compare atlas.clustering='oracle'); MIRA's graph should "
            "weight the same-task neighbours; FedAvg mixes both tasks.",
            clients=6,
            rounds=3,
            overrides={**_PLENTY, "data.tasks": "boolq,asdiv", "data.partitioning": "by-task"},
        ),
        Preset(
            "few-shot-pairs",
            "8 clients, 4 tasks x 2 clients (ASDiv, BoolQ, XSum, CommonsenseQA; clients c and c + 4 share a task), 24 "
            "training examples each, 64 held-out: alone a client overfits its few examples; its task partner holds "
            "as many more, so collaboration should pay, and averaging all four tasks should not.",
            clients=8,
            rounds=4,
            overrides=dict(_FEW_SHOT),
        ),
        Preset(
            "few-shot-partnerless",
            "6 clients on the few-shot budget: ASDiv and BoolQ on two clients each (0 and 4, 1 and 5), XSum (client "
            "2) and CommonsenseQA (client 3) on one each: the partnered clients should gain from sharing, and the "
            "two with nobody to share with must not pay for it (a structure no other preset has; every default is "
            "to be checked here as well as where it was chosen).",
            clients=6,
            rounds=4,
            overrides=dict(_FEW_SHOT),
        ),
        Preset(
            "few-shot-mixed-models",
            f"few-shot-pairs with two base models: clients 0-3 load {SMOLLM2_ALIAS}, clients 4-7 {QWEN_CODER_ALIAS}, "
            "so each task's two clients have DIFFERENT models: FedAvg can only average within a model (across all "
            "four tasks); SimGrad can share within a task across models.",
            clients=8,
            rounds=4,
            overrides={**_FEW_SHOT, "model.partition-models": ",".join([SMOLLM2_ALIAS] * 4 + [QWEN_CODER_ALIAS] * 4)},
        ),
        Preset(
            "many-members",
            "100 clients, 25 a task (ASDiv, BoolQ, XSum, CommonsenseQA), 10 sampled to train each round, every client "
            "evaluated (4 held-out examples) before round 1 and after the last: member-level differential privacy's "
            "setting, where the noise on a round's mean falls as 1 / the members summed; FedAvg with dp.* at "
            "several epsilons against FedAvg without.",
            clients=100,
            rounds=5,
            overrides={
                **_BUDGET,
                "train.local-steps": 4,
                "data.partitioning": "by-task",
                "data.max-examples-per-task": 400,
                "fraction-train": 0.1,
                "fraction-evaluate": 0.1,
                "evaluate-all-every": 5,
                "eval.max-examples": 4,
                "eval.generate-examples": 1,
            },
            primary={"statistic": "mean client", "references": ["fedavg"]},
        ),
        Preset(
            "cross-silo",
            "4 organisations, two per task (BoolQ, ASDiv), 1,000-1,400 training records each (every record the banks "
            "hold; 10 % held out, 3 % validation): record-level DP-SGD's setting (dp.record-epsilon), where the noise "
            "on a step falls as 1 / the expected batch. Expected batches of 16, 3 steps a round, prompts cut at 250 "
            "characters; the loss on 48 held-out examples at round 0 and the end, 2 of them generated.",
            clients=4,
            rounds=2,
            overrides={
                **_BUDGET,
                "eval.final-examples": 48,
                "data.tasks": "boolq,asdiv",
                "data.partitioning": "by-task",
                "data.max-examples-per-task": 4000,
                "data.max-prompt-chars": 250,
                "data.test-fraction": 0.1,
                "data.validation-fraction": 0.03,
                "train.batch-size": 16,
                "train.local-steps": 3,
                "eval.generate-examples": 2,
            },
            primary={"statistic": "worst client", "references": ["local"]},
        ),
        Preset(
            "ni-categories",
            "6 clients on Natural-Instructions (seed 002's setting, VEMoE's home): three keyword categories (question "
            "generation, answer generation, incorrect answer) of two sub-tasks each, two clients per category, the "
            "few-shot budget (24 training examples, 64 held-out): experts should specialise by category.",
            clients=6,
            rounds=4,
            overrides={
                **_FEW_SHOT,
                "data.source": "natural-instructions",
                "data.keyword-categories": "question generation,answer generation,incorrect answer",
                "data.tasks-per-category": 2,
            },
        ),
    )
}


def preset(name: str) -> Preset:
    """The preset called ``name`` (ValueError listing the presets otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"--preset: '{name}' is not a preset (have {', '.join(PRESETS)})")
    return PRESETS[name]


def toml_value(value: Value) -> str:
    """A run-config value as ``flwr run --run-config`` reads it (strings quoted, booleans lower case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if "'" in value:
            raise ValueError(f"run-config value {value!r}: a single quote cannot be passed to flwr run")
        return f"'{value}'"
    return repr(value)
