"""VEMoE's wire: its part of a train instruction (``VemoeWire``, ``StrategySpec.wire``) and the names of what its
two halves send each other, read by both ``server.py`` and ``client.py`` (and ``pool.py``, which builds and reads
the payload). The experts themselves travel under the expert-pool adapter's names (``expert-<slot>.*``,
``common.adapters.experts.adapter``)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from common.messages import Floats, Int, Part

# payload arrays, both ways: each slot's responsibility (server -> client: 1 for a live slot, 0 for a free one)
# and the birth vote (client -> server: 0 or 1; zero from the server)
RESPONSIBILITY, VOTE = "responsibility", "birth-vote"
# client -> server, summed with the rest: each pair of live slots' probe-loss gap |L_k - L_l| (K_max x K_max,
# flattened) and each live slot's move |L_base - L_k| from the client's probe loss with no expert routed: from
# their sums the server measures how differently two experts serve the clients (``pool.functional_distance``)
GAP, MOVE = "probe-gap", "probe-move"


class VemoeWire(Part):
    """VEMoE's keys of a train instruction."""

    about: ClassVar[str] = "vemoe"
    birth_slot: Int = Field(-1, alias="vemoe-birth-slot", ge=-1)  # the free slot a voter puts its candidate in
    prior: Floats | None = Field(None, alias="vemoe-prior")  # vemoe.likelihood = "summed": each slot's prior


# train-reply metrics (plain mode only): each slot's probe loss (-1: free), r, the routed slots, the birth vote
PROBE_METRIC, R_METRIC, TOP_METRIC, VOTE_METRIC = "vemoe_probe", "vemoe_r", "vemoe_top", "vemoe_vote"


BESIDE_POOL = (RESPONSIBILITY, VOTE, GAP, MOVE)  # the payload's arrays that are not an expert
# what each reply metric holds (the ServerApp checks a plain-mode reply's metrics against it)
REPLY_METRICS: dict[str, type | None] = {PROBE_METRIC: float, R_METRIC: float, TOP_METRIC: int, VOTE_METRIC: None}


def beside_pool(k_max: int, live: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The payload's arrays beside the experts, zero (``live``: the server's 1 / 0 per slot as the
    responsibility): one shape both ways, as SecAgg+ needs."""
    responsibility = np.zeros(k_max) if live is None else np.asarray(live)
    return {
        RESPONSIBILITY: responsibility.astype(np.float32),
        VOTE: np.zeros(1, np.float32),
        GAP: np.zeros(k_max * k_max, np.float32),
        MOVE: np.zeros(k_max, np.float32),
    }


def routing_metrics(losses: np.ndarray, r: np.ndarray, top: list[int], vote: bool) -> dict[str, Any]:
    """What routing decided, as a plain-mode train reply's metrics: each slot's probe loss (-1: free), r, the
    routed slots and the vote."""
    return {
        PROBE_METRIC: [round(float(x), 6) if np.isfinite(x) else -1.0 for x in losses],
        R_METRIC: [round(float(x), 6) for x in r],
        TOP_METRIC: list(top),
        VOTE_METRIC: int(vote),
    }
