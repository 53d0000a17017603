"""Which nodes take part: a node's identity and initial adapter are checked before the server trusts either.

A node says who it is (its node-config ``partition-id`` and the base model it loaded) and sends its fresh adapter in
its answer to the initial query. All of it is the node's word, so before round 1 (``admit_clients``) and when a node
joins mid-run (``server_app.app._admit_new_nodes``):

- identity (``read_identity``): a whole partition id in [0, 2^31) and a model name of printable characters, at most
  ``MAX_MODEL_NAME`` long (it names checkpoint groups and adapter directories);
- one node per partition id: the lowest node id keeps it, later claimants are left out; with
  ``robust.bind-partitions`` (deployments with SuperNode authentication, where Flower derives a node's id from its
  registered public key, so the id survives restarts) a partition stays the first admitted node's for the whole run
  (and a resumed one): another node claiming it is left out even while its owner is offline;
- initial adapters: every client of one base model builds the same seeded adapter, so the clients of a model must
  agree (names, shapes, values); the adapter most of them sent is that model's start and a node that sent another
  is left out (it would otherwise become a family's start for everyone: FedAvg adopts one client's);
- in secure mode, a strategy that refuses a model family too small for SecAgg+ (fewer than 3) has that family's
  nodes left out instead of the run refused.

A node left out is named with its reason and not asked again; the run starts only if ``min-train-replies`` nodes
remain.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from common.logs import get_logger
from common.records import ReplyError, adapter_digest
from common.secure_bounds import MIN_SECURE_GROUP
from strategies import Strategy
from strategies.base import Arrays, ClientInfo
from strategies.families import family_key

log = get_logger("tessera.server")

MAX_MODEL_NAME = 200
MAX_PARTITION_ID = 2**31 - 1


def read_identity(identity: dict[str, Any]) -> tuple[int, str]:
    """A node's (partition id, model) from its initial reply's identity, or ``ReplyError`` with the reason."""
    partition = identity.get("partition-id")
    if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition <= MAX_PARTITION_ID:
        raise ReplyError(f"partition-id must be a whole number in [0, {MAX_PARTITION_ID}], got {str(partition)[:40]!r}")
    model = identity.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME or not model.isprintable():
        shown = model[:40] + "..." if isinstance(model, str) and len(model) > 40 else model
        size = len(model) if isinstance(model, str) else type(model).__name__
        raise ReplyError(f"model must be a printable name of 1..{MAX_MODEL_NAME} characters, got {shown!r} ({size})")
    return partition, model


class Admission:
    """The checks above, with what the first admission agreed on (each model's initial adapter) kept for nodes
    that join later."""

    def __init__(self, bind: bool = False) -> None:
        self.bind = bind
        self.owner: dict[int, int] = {}  # partition id -> the node it is bound to (only with ``bind``)
        self.start_digest: dict[str, str] = {}  # model -> the digest of its agreed initial adapter
        self.adapters: dict[str, tuple[str, Arrays]] = {}  # model -> (that digest, the adapter): for later joiners

    def admit(self, clients: dict[int, ClientInfo]) -> tuple[dict[int, ClientInfo], dict[int, str]]:
        """The clients that pass, and node id -> reason for those left out."""
        left_out: dict[int, str] = {}
        holder: dict[int, int] = {}
        for nid, info in sorted(clients.items()):
            owner = self.owner.get(info.partition_id, nid) if self.bind else nid
            if info.partition_id in holder:
                left_out[nid] = f"partition {info.partition_id} is already node {holder[info.partition_id]}'s"
            elif owner != nid:
                left_out[nid] = (
                    f"partition {info.partition_id} is bound to node {owner}, admitted with it first "
                    "(robust.bind-partitions: a node id is its registered key)"
                )
            else:
                holder[info.partition_id] = nid
        digests = {
            nid: info.digest or adapter_digest(info.initial) for nid, info in clients.items() if nid not in left_out
        }
        by_model: dict[str, list[int]] = {}
        for nid in sorted(digests):
            by_model.setdefault(clients[nid].model, []).append(nid)
        for model, nids in by_model.items():
            if model not in self.start_digest:
                counts = Counter(digests[n] for n in nids)
                (best, votes), *rest = counts.most_common()
                if rest and votes == rest[0][1]:  # no majority: nothing tells the honest adapter apart
                    # the model's clients sit this admission out (a later one, with more of them, may agree); one
                    # hostile client of a model with two no longer stops the run of every other model
                    why = (
                        f"the {len(nids)} clients of model {model!r} sent {len(counts)} different initial adapters "
                        "with no majority; clients of one model must build the same seeded adapter"
                    )
                    left_out.update({nid: why for nid in nids})
                    continue
                self.start_digest[model] = best
            for nid in nids:
                if digests[nid] != self.start_digest[model]:
                    left_out[nid] = f"its initial adapter differs from the one the clients of {model!r} agree on"
                elif model not in self.adapters and clients[nid].initial:
                    self.adapters[model] = (digests[nid], clients[nid].initial)
        admitted = {nid: info for nid, info in clients.items() if nid not in left_out}
        if self.bind:
            for nid, info in admitted.items():
                self.owner.setdefault(info.partition_id, nid)
        return admitted, left_out


def initialise_strategy(
    strategy: Strategy, clients: dict[int, ClientInfo], secure: bool
) -> tuple[dict[int, ClientInfo], dict[int, str]]:
    """``strategy.initialise(clients)``; in secure mode, if the strategy refuses because a model family is too small
    for SecAgg+, once more without that family's nodes (left out, with the reason). Raises the strategy's
    ValueError otherwise."""
    try:
        strategy.initialise(dict(clients))
        return clients, {}
    except ValueError as err:
        sizes = Counter(family_key(info.model) for info in clients.values())
        small = {family for family, n in sizes.items() if n < MIN_SECURE_GROUP}
        if not secure or not small or len(small) == len(sizes):
            raise
        reason = f"secure=true: its model family has fewer than {MIN_SECURE_GROUP} clients ({err})"
        left_out = {nid: reason for nid, info in clients.items() if family_key(info.model) in small}
        kept = {nid: info for nid, info in clients.items() if nid not in left_out}
        strategy.initialise(dict(kept))
        return kept, left_out


def slim(info: ClientInfo) -> ClientInfo:
    """What the server keeps of an admitted client once the strategy has read it: its identity without its initial
    adapter (the strategy kept what it needs, e.g. one global per model; a LoRA is ~2 MB a client, which 1,000
    idle clients would hold for the whole run)."""
    return dataclasses.replace(info, initial={})


def log_left_out(left_out: dict[int, str]) -> None:
    for nid, reason in sorted(left_out.items()):
        log.warning("node %d left out: %s", nid, reason)
