"""A round's training on the server: the strategy's groups trained through the plain or the SecAgg+ transport,
what their replies are held to (``reply_limits``) and the per-node train rows of the round (``train_rows``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid

from common.adapters import adapter_kind
from common.config import RunConfig
from common.guard import TRAIN_GUARD_METRICS
from common.logs import get_logger
from common.records import num_bytes
from common.reply_checks import (
    MEMBER_LEDGER_METRICS,
    RECORD_DP_METRICS,
    TRAIN_OPTIONAL,
    ReplyLimits,
    reply_metric_specs,
)
from strategies import Strategy, strategy_spec
from strategies.base import GroupResult

from . import privacy
from .offenders import Offenders, combine, refuse_unsound_sums
from .secure import train_groups_secure
from .transport import train_groups_plain

log = get_logger("tessera.server")


def train_round(
    grid: Grid,
    context: Context,
    cfg: RunConfig,
    strategy: Strategy,
    server_round: int,
    node_ids: list[int],
    offenders: Offenders,
    limits: ReplyLimits,
) -> tuple[list[GroupResult], list[GroupResult]]:
    """Train the strategy's groups; (the results as trained: a secure group holding suspects as its subgroups, one
    per group for the strategy: subgroups combined). Group means the strategy's ``check_sum`` refuses have none."""
    secure = cfg.secure and strategy.aggregates
    planned = strategy.train_groups(server_round, node_ids)
    groups = offenders.split(server_round, planned) if secure else planned
    privacy.prepare(cfg, groups)  # dp.*: equal weights, the clip norm, distributed noise (else nothing)
    for group in groups:
        log.info(
            "round %d: training group %s (%d clients)%s",
            server_round,
            group.name,
            len(group.members),
            " via SecAgg+" if cfg.secure and strategy.aggregates else "",
        )
    if secure:  # one SecAgg+ run per group, the groups at once (train_groups_secure)
        results = train_groups_secure(grid, context, server_round, groups, cfg.secagg, limits)
    else:
        results = train_groups_plain(grid, server_round, groups, cfg.round_timeout, limits, strategy.check_sum)
        privacy.add_central_noise(cfg, results)
    for group, result in zip(groups, results):
        for nid in result.metrics:
            sent, received = num_bytes(group.reply_reference(nid)), num_bytes(group.start[nid])
            result.metrics[nid].setdefault("bytes_up", sent)
            result.metrics[nid]["bytes_down"] = received
            # layerwise routing: adapter bytes a member did NOT send because its routing left its blocks out
            result.metrics[nid]["routing_bytes_saved"] = received - sent
    refuse_unsound_sums(strategy, server_round, results)
    if secure:
        offenders.observe(server_round, results)
    return results, combine(planned, results)


def reply_limits(cfg: RunConfig, max_update_norm: float | None = None) -> ReplyLimits:
    """What this run's train replies are held to: the instruction's example budget and ``robust.*`` (the update
    norm bound as chosen for the round, ``chosen_max_update_norm``; default: ``robust.max-update-norm``)."""
    declared = {**adapter_kind(cfg.adapter).reply_metrics, **strategy_spec(cfg.strategy).server.reply_metrics}
    return ReplyLimits(
        examples_per_round=examples_per_round(cfg),
        max_update_norm=max_update_norm or cfg.robust.max_update_norm,
        clip_norm=_clip_norm(cfg),
        private=cfg.dp.enabled,
        optional_metrics={**TRAIN_OPTIONAL, **reply_metric_specs(declared)},
    )


def _clip_norm(cfg: RunConfig) -> float | None:
    """The norm updates are scaled back to (None: none): ``robust.clip-norm``, and ``dp.clip-norm`` when private
    (in central mode the server clips what it sees, besides the members' own clipping)."""
    norms = [n for n in (cfg.robust.clip_norm, cfg.dp.clip_norm if cfg.dp.enabled else 0.0) if n > 0]
    return min(norms) if norms else None


def examples_per_round(cfg: RunConfig) -> int:
    """The most examples one member trains on in a round: what its weight (``num_examples``) is capped at."""
    train = cfg.train_settings()
    return train.local_steps * train.batch_size * train.grad_accum_steps


def train_rows(
    results: list[GroupResult], aggregate_seconds: float, extra: dict[str, type | None]
) -> dict[int | None, dict[str, Any]]:
    """Per node: the train metrics every run has, and ``extra``: what the adapter kind and the strategy add (already
    parsed into numbers and lists where the reply was checked: ``reply_limits``' ``optional_metrics``)."""
    rows: dict[int | None, dict[str, Any]] = {None: {"aggregate_seconds": aggregate_seconds, "rejected": {}}}
    for result in results:
        for nid, metrics in result.metrics.items():
            rows[nid] = {
                "group": result.name,
                "train_loss": metrics.get("train_loss"),
                "train_tokens": metrics.get("train_tokens"),
                "train_seconds": metrics.get("train_seconds"),
                "tokens_per_second": metrics.get("tokens_per_second"),
                "loss_tokens_per_second": metrics.get("loss_tokens_per_second"),  # tokens that carry a loss
                **{k: metrics[k] for k in ("train_loss_tokens", "gpu_peak_allocated_mb") if k in metrics},
                **{k: metrics[k] for k in MEMBER_LEDGER_METRICS if k in metrics},  # dp.*: the member's own ledger
                **{k: metrics[k] for k in RECORD_DP_METRICS if k in metrics},  # DP-SGD: what the member has spent
                "bytes_up": metrics.get("bytes_up", 0),
                "bytes_down": metrics.get("bytes_down", 0),
                "routing_bytes_saved": metrics.get("routing_bytes_saved", 0),
                "update_norm": metrics.get("update_norm"),  # L2 from what it was sent (secure: the member's word)
                "accepted": nid in result.contributors,
                **{k: metrics[k] for k in TRAIN_GUARD_METRICS if k in metrics},  # what it kept of what it was sent
                **{k: metrics[k] for k in extra if k in metrics},  # typed where the reply was checked
            }
            if clipped := metrics.get("secagg_clipped"):  # values SecAgg+ clamped to its range (the member counted)
                rows[nid]["secagg_clipped"] = clipped
                rows[None]["secagg_clipped"] = rows[None].get("secagg_clipped", 0) + clipped
                log.warning("node %d: SecAgg+ clipped %d values to its range", nid, clipped)
            if metrics.get("robust"):  # capped weight, clipped update (common.reply_checks)
                rows[nid]["robust"] = metrics["robust"]
                rows[None]["robust_adjusted"] = rows[None].get("robust_adjusted", 0) + 1
        rows[None]["rejected"].update({str(n): why for n, why in result.rejected.items()})
        if result.aggregate_rejected:  # a secure group's aggregate refused as a whole (server_app.secure)
            rows[None].setdefault("aggregates_rejected", {})[result.name] = result.aggregate_rejected
    norms = [
        r["update_norm"] for n, r in rows.items() if n is not None and r["accepted"] and r["update_norm"] is not None
    ]
    if norms:  # what honest updates look like this round: robust.max-update-norm is chosen against it
        rows[None]["update_norm_median"] = float(np.median(norms))
    return rows
