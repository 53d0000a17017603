"""Record-level DP-SGD as a member runs it: its budget (its node config first), the round's noise, its ledger.

A member's node config may set its own budget beside its ``data-path``: ``dp-record-epsilon`` (the target),
``dp-record-delta``, ``dp-record-clip`` (C) and ``dp-record-noise-multiplier`` (z). The run config's ``dp.record-*``
give the defaults (what simulation uses) and may lower a member's target (``dp.record-max-epsilon``) or delta, never
raise them; a member's own setting always applies, whether the run asks for record-level DP or not.

Each round (``plan_round``): the sampling rate ``q`` = expected batch / training records; ``z`` as set, else the
least that keeps every step the member's ledger holds plus the rest of the run's planned steps (rounds left x
local steps) within its target; if this round's steps would take it past its target, the member stops training
(``BudgetSpent``: the server logs it and goes on with the others; its evaluation goes on). After the steps, and
before the update leaves, they go into the member's ledger (``client_app.member_ledger``), which a restarted
SuperNode or a resumed run goes on from. Errors name the node's key, never its value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import Context

from common.config import RunConfig, TrainSection
from common.node_config import node_settings
from common.record_privacy import (
    MAX_RECORD_NOISE,
    RecordBudget,
    Steps,
    effective_budget,
    record_epsilon,
    record_noise_for,
    sampling_rate,
)
from common.reply_checks import RECORD_DP_METRICS

from . import member_ledger


class BudgetSpent(RuntimeError):
    """The member's record-level budget cannot carry another round: it trains no more (its evaluation goes on)."""


@dataclass(frozen=True)
class RoundPlan:
    """One round's DP-SGD for one member: its budget, sampling rate, noise multiplier and what it will have spent."""

    budget: RecordBudget
    q: float
    z: float
    steps: int
    epsilon_after: float


def node_budget(context: Context, cfg: RunConfig) -> RecordBudget | None:
    """The record-level budget this member trains under (None: no record-level DP for it)."""
    node = node_settings(context.node_config)  # its own budget, checked (node-config dp-record-*)
    dp = cfg.dp
    return effective_budget(
        node.dp_record_epsilon,
        node.dp_record_delta,
        node.dp_record_clip,
        dp.record_default(node.partition_id),
        dp.record_max_epsilon,
        dp.record_delta,
        dp.record_clip_norm,
    )


def refusal(cfg: RunConfig) -> str | None:
    """Why this run cannot keep a member's records within its DP-SGD budget (None: it can): its strategy computes
    something from them outside the DP-SGD steps, or the guard chooses on them."""
    from strategies import strategy_spec

    spec = strategy_spec(cfg.strategy)
    if spec.record_dp_refusal:
        return f"node-config dp-record-epsilon: strategy '{spec.name}' cannot keep it: {spec.record_dp_refusal}"
    if cfg.guarded:
        return (
            "node-config dp-record-epsilon: the do-no-harm guard (guard.enabled) chooses on the member's validation "
            "records outside DP-SGD"
        )
    return None


def given_noise(context: Context, cfg: RunConfig) -> float:
    """z as the member's node config, else the run, sets it (0: calibrated from the target)."""
    return node_settings(context.node_config).dp_record_noise_multiplier or cfg.dp.record_noise_multiplier


def plan_round(
    context: Context, cfg: RunConfig, budget: RecordBudget, settings: TrainSection, records: int, server_round: int
) -> RoundPlan:
    """This round's DP-SGD (see the module docstring); ``BudgetSpent`` when it would pass the member's target,
    ValueError naming the key when the training split is too small to sample from."""
    try:
        q = sampling_rate(settings.batch_size * settings.grad_accum_steps, records)
    except ValueError as err:
        raise ValueError(f"train.batch-size: {err}") from None
    spent = member_ledger.record_steps(context)
    z = given_noise(context, cfg)
    if not z:
        rounds_left = max(1, cfg.num_server_rounds - server_round + 1)
        steps = rounds_left * settings.local_steps
        try:
            z = record_noise_for(budget.epsilon, budget.delta, q, steps, tuple(spent))
        except ValueError as err:
            if spent:
                raise BudgetSpent(f"record-level budget spent: {err}; this member trains no more") from None
            key = "node-config dp-record-epsilon" if budget.source == "node" else "dp.record-epsilon"
            raise ValueError(  # nothing spent yet: the target itself is out of reach (its value stays on the node)
                f"{key}: no noise multiplier up to {MAX_RECORD_NOISE:g} keeps this run's {steps} planned DP-SGD "
                "steps within it; raise it, or plan fewer rounds or local steps"
            ) from None
    after = record_epsilon([*spent, Steps(q, z, settings.local_steps)], budget.delta)
    if after > budget.epsilon * (1 + 1e-6):
        before = record_epsilon(spent, budget.delta)
        raise BudgetSpent(
            f"record-level budget spent: epsilon {before:.3f} of {budget.epsilon:g} (delta {budget.delta:g}) so far; "
            f"this round would take it to {after:.3f}; this member trains no more"
        )
    return RoundPlan(budget, q, z, settings.local_steps, after)


def round_metrics(plan: RoundPlan) -> dict[str, Any]:
    """What a train row says of the member's record-level privacy after this round."""
    values = (plan.epsilon_after, plan.budget.epsilon, plan.budget.delta, plan.z, plan.q)
    return dict(zip(RECORD_DP_METRICS, values))
