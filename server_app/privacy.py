"""Differential privacy on the server's side (``dp.*``; the math is ``common.privacy``, the page docs/privacy.md).

Per round: every group's members are weighted equally (an example count used as a weight would be a release of
its own, and one member's share of the sum must not grow with it), told the norm to clip their update to and, in
distributed mode, the noise they add before masking (sized for the fewest members the group's sum can be unmasked
with); in central mode the server adds the noise to each group's mean. The accountant composes the noise of every
release of the run (the write-ahead ledger, ``server_app.ledger``: a round is counted before it is sent, and a round
redone after a resume is counted again); a run with a target stops before the round that would exceed it, and every
aggregate row says what has been spent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.config import RunConfig
from common.messages import DpPart
from common.privacy import (
    epsilon_of,
    fewest_members,
    noise_norm_bound,
    quantisation_problem,
    share_std,
    sum_std,
    with_noise,
)
from common.secure_bounds import reconstruction_threshold
from strategies.base import WEIGHT_EQUALLY, Group, GroupResult


def noise_multiplier(cfg: RunConfig) -> float:
    """z for this run: ``dp.noise-multiplier``, else the least that spends ``dp.target-epsilon`` in
    ``num-server-rounds`` rounds."""
    return cfg.dp.planned_noise(cfg.num_server_rounds)


def about(cfg: RunConfig) -> dict[str, Any]:
    """What a ledger line says of a round's privacy besides its noise multiplier (``server_app.ledger``)."""
    dp = cfg.dp
    return {"mode": dp.mode, "clip_norm": dp.clip_norm, "delta": dp.delta} if dp.enabled else {"mode": "off"}


def stop_reason(cfg: RunConfig, spent: Sequence[float], server_round: int) -> str | None:
    """Why round ``server_round`` must not run (None: it may): it would take the run past ``dp.target-epsilon``."""
    dp = cfg.dp
    if not dp.enabled or dp.target_epsilon == 0:
        return None
    after = epsilon_of([*spent, noise_multiplier(cfg)], dp.delta)
    if after <= dp.target_epsilon * (1 + 1e-6):  # the calibration's own tolerance
        return None
    return (
        f"dp.target-epsilon: round {server_round} would spend epsilon {after:.3f} in all, beyond the target "
        f"{dp.target_epsilon:g} (delta {dp.delta:g}); the run stops after round {server_round - 1}"
    )


def prepare(cfg: RunConfig, groups: list[Group]) -> None:
    """Make this round's groups private: equal weights, the clip norm and (distributed) each member's noise."""
    if not cfg.dp.enabled:
        return
    z, clip_norm = noise_multiplier(cfg), cfg.dp.clip_norm
    for group in groups:
        group.weight_by, group.max_weight = WEIGHT_EQUALLY, None
        share = None
        if cfg.dp.mode == "distributed":
            size = len(group.members)
            threshold = reconstruction_threshold(size, cfg.secagg.num_shares, cfg.secagg.reconstruction_threshold)
            share = share_std(z, clip_norm, fewest_members(size, threshold))
            problem = quantisation_problem(share, clip_norm, cfg.secagg.clipping_range, cfg.secagg.quantization_range)
            if problem:
                raise ValueError(problem)
        # z and delta: what the member's ledger records
        group.dp = DpPart(clip_norm=clip_norm, noise_multiplier=z, delta=cfg.dp.delta, noise_std=share)


def add_central_noise(cfg: RunConfig, results: list[GroupResult], rng: np.random.Generator | None = None) -> None:
    """Central mode: each group's (equally weighted) mean gets N(0, (z C / n)^2) per coordinate, n its members in
    the mean: the sum's N(0, (z C)^2) divided by n."""
    if cfg.dp.mode != "central":
        return
    z = noise_multiplier(cfg)
    for result in results:
        if result.mean is not None and result.contributors:
            result.mean = with_noise(result.mean, sum_std(z, cfg.dp.clip_norm) / len(result.contributors), rng)


def distance_allowance(group: Group, contributors: int, dimension: int) -> float:
    """What distributed noise may add to a group mean's distance from its start (0 without noise): the members'
    shares sum to at least N(0, (z C)^2), over ``contributors`` in the mean."""
    share = group.dp.noise_std if group.dp is not None and group.dp.noise_std is not None else 0.0
    if share == 0 or contributors == 0:
        return 0.0
    return noise_norm_bound(share / np.sqrt(contributors), dimension)


def round_row(cfg: RunConfig, spent: Sequence[float]) -> dict[str, Any]:
    """What the aggregate row says of the privacy spent after this round (nothing when ``dp.mode`` is off)."""
    if not cfg.dp.enabled:
        return {}
    return {
        "dp_mode": cfg.dp.mode,
        "dp_noise_multiplier": spent[-1] if spent else noise_multiplier(cfg),
        "dp_clip_norm": cfg.dp.clip_norm,
        "dp_delta": cfg.dp.delta,
        "dp_epsilon": epsilon_of(spent, cfg.dp.delta),
    }


def record_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The run's last lines on record-level DP-SGD: each member's epsilon spent, from its last train row that says
    (the member's own accounting, ``client_app.record_dp``); nothing when no member trained by DP-SGD."""
    last: dict[Any, dict[str, Any]] = {}
    for row in rows:
        if row.get("node") is not None and row.get("dp_record_epsilon") is not None:
            last[row.get("partition_id", row["node"])] = row
    return [
        f"record-level DP-SGD, partition {p}: epsilon {r['dp_record_epsilon']:.3f} of {r['dp_record_target']:g} at "
        f"delta {r['dp_record_delta']:g} after round {r['round']} (z {r['dp_record_noise_multiplier']:.3g})"
        for p, r in sorted(last.items(), key=lambda item: str(item[0]))
    ]
