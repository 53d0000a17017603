"""Which clients take part in a round (Flower's vocabulary: ``fraction-train``, ``min-train-nodes``, ...).

Sampling is over partitions, not node ids: a node id is new every run (and after a SuperNode restart), a partition is
not, so the same ``seed`` samples the same clients in a rerun and in a resumed run. Pure functions, no Flower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from common.logs import get_logger

if TYPE_CHECKING:
    from common.config import RunConfig
    from strategies.base import ClientInfo

log = get_logger("tessera.server")

TRAIN, EVALUATE = 0, 1  # independent random streams per round: the evaluation sample is not the training one


def sample_size(available: int, fraction: float, minimum: int) -> int:
    """Flower's rule: ``int(available * fraction)``, at least ``minimum``, at most ``available``."""
    return min(available, max(int(available * fraction), minimum))


def sample_nodes(
    partition_of: Mapping[int, int], fraction: float, minimum: int, seed: int, server_round: int, stream: int = TRAIN
) -> list[int]:
    """The node ids of a seeded sample of ``sample_size`` clients (every node when that is all of them), sorted.

    Args:
        partition_of: node id -> partition id of every node that can take part this round.
        fraction, minimum: ``fraction-train`` / ``min-train-nodes`` (or the evaluate pair).
        seed, server_round, stream: the draw is a function of these and of the partitions alone.
    """
    nodes = sorted(partition_of, key=lambda nid: partition_of[nid])
    size = sample_size(len(nodes), fraction, minimum)
    if size >= len(nodes):
        return sorted(nodes)
    rng = np.random.default_rng([seed, server_round, stream])
    return sorted(nodes[i] for i in rng.choice(len(nodes), size=size, replace=False))


def evaluates_everyone(server_round: int, fraction_evaluate: float, evaluate_all_every: int) -> bool:
    """Whether every client is evaluated this round: always with ``fraction-evaluate=1``, else on the rounds that
    are multiples of ``evaluate-all-every`` (round 0 included, so every client has a starting point; 0: never)."""
    return fraction_evaluate >= 1 or (evaluate_all_every > 0 and server_round % evaluate_all_every == 0)


def round_participants(
    cfg: RunConfig, node_ids: list[int], clients: Mapping[int, ClientInfo], server_round: int
) -> tuple[list[int], list[int]]:
    """This round's (training, evaluation) node ids among ``node_ids``; the samples are drawn from the ones the
    strategy knows (``clients``). A client that trains is evaluated too (its row carries what it trained and what
    that did); round 0 trains nobody."""
    partition_of = {nid: clients[nid].partition_id for nid in node_ids if nid in clients}
    trained: list[int] = []
    if server_round > 0:
        floor = max(cfg.min_train_nodes, cfg.min_train_replies)
        trained = sample_nodes(partition_of, cfg.fraction_train, floor, cfg.seed, server_round, TRAIN)
        if len(trained) < len(partition_of):
            partitions = sorted(partition_of[nid] for nid in trained)
            log.info(
                "round %d: sampled %d of %d clients: partitions %s",
                server_round,
                len(trained),
                len(partition_of),
                partitions,
            )
    if evaluates_everyone(server_round, cfg.fraction_evaluate, cfg.evaluate_all_every):
        # everyone the strategy knows: a node left out at admission (its data refused, say) has no adapter to test
        return trained, [nid for nid in node_ids if nid in partition_of]
    sample = sample_nodes(partition_of, cfg.fraction_evaluate, cfg.min_evaluate_nodes, cfg.seed, server_round, EVALUATE)
    return trained, sorted(set(sample) | set(trained))
