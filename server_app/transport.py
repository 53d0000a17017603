"""How a group's mean reaches the server: plain sums in the clear (here), or Flower's SecAgg+ workflow
(``server_app.secure``).

``train_groups_plain`` (all groups' members at once) and ``secure.train_group_secure`` (one group) return
``strategies.GroupResult``s; strategies never see which one ran. Members receive their start adapter and return
the group's ``send_back`` names (all of them, or the routed blocks). Plain mode validates every reply (keys,
shapes, NaN/Inf, num_examples) and leaves bad ones out with a logged reason. Secure mode runs one
``SecAggPlusWorkflow`` for the group with a fresh ``LegacyContext`` whose legacy strategy only selects the group
and captures the unmasked mean; clients refuse to mask a non-finite update, and SecAgg+ treats them as dropped.
``query_clients`` and ``collect_reports`` gather the clients' identities and (for strategies that ask) their
per-round reports.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Message, MessageType, RecordDict

from common.logs import get_logger, one_line
from common.messages import (
    ADAPTER_DIGEST,
    QUERY_INITIAL,
    QUERY_REPORT,
    WEIGHT_BY_EXAMPLES,
    Part,
    QueryPart,
    RoundPart,
    SecAggPart,
    WeightingPart,
    encode,
)
from common.records import (
    ReplyError,
    adapter_digest,
    eval_instruction,
    num_bytes,
    query_instruction,
    read_initial_reply,
    read_metrics,
    read_report_reply,
    read_train_reply,
    train_instruction,
)
from common.reply_checks import (
    ReplyLimits,
    check_eval_metrics,
    check_metrics,
    check_update,
    check_weight,
    clip_update,
    update_norm,
)
from server_app.admission import read_identity
from strategies.aggregation import weighted_mean
from strategies.base import Arrays, ClientInfo, Group, GroupResult

log = get_logger("tessera.server")


# Flower 1.41-1.42's simulation engine (its in-memory link state) looks for each node's next message by scanning every
# stored message, for every node, every 0.1 s: 1,000 clients with 1,000 messages in flight is a million checks per
# sweep under the state's lock (with 1,000 clients, start to round 1 took 704 s at once, 351 s with the window:
# docs/scale.md). A window of this many messages in flight keeps the scan small and every Ray actor busy.
SIMULATION_WINDOW = 64
PULL_INTERVAL = 0.1


def _in_simulation(grid) -> bool:
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def _send(grid, messages: list[Message], timeout: float) -> dict[int, Message | str]:
    """Send and wait; map every destination to its reply, or to the reason there is none."""
    out: dict[int, Message | str] = {m.metadata.dst_node_id: f"no reply within {timeout:.0f}s" for m in messages}
    if len(messages) > SIMULATION_WINDOW and _in_simulation(grid):
        replies = _send_windowed(grid, messages, timeout, SIMULATION_WINDOW)
    else:
        replies = list(grid.send_and_receive(messages, timeout=timeout))
    # by the message it answers (ids are set once sent): the SuperLink itself answers for a node that went offline
    sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
    for reply in replies:
        nid = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        out[nid] = f"client error: {_short_reason(reply.error.reason or '')}" if reply.has_error() else reply
    return out


def _send_windowed(grid, messages: list[Message], timeout: float, window: int) -> list[Message]:
    """``grid.send_and_receive`` with at most ``window`` messages waiting for a reply at any time (a new one is pushed
    as each reply comes in); ``timeout`` bounds the whole exchange, as it does for ``send_and_receive``."""
    deadline = time.monotonic() + timeout
    queue = list(messages)
    waiting: set[str] = set()
    replies: list[Message] = []
    while (queue or waiting) and time.monotonic() < deadline:
        if queue and len(waiting) < window:
            batch, queue = queue[: window - len(waiting)], queue[window - len(waiting) :]
            waiting.update(mid for mid in grid.push_messages(batch) if mid)
        if not waiting:
            continue
        pulled = list(grid.pull_messages(list(waiting)))
        replies.extend(pulled)
        waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
        if not pulled:
            time.sleep(PULL_INTERVAL)
    return replies


def _content(reply: Message | str) -> RecordDict:
    """A reply's content, or ReplyError with the reason ``_send`` gave for the missing reply."""
    if isinstance(reply, str):
        raise ReplyError(reply)
    return reply.content


def _short_reason(reason: str, limit: int = 400) -> str:
    """The client's own exception message, without the Ray / Flower traceback wrapped around it."""
    marker = "Message: "
    if marker in reason:
        reason = reason.rsplit(marker, 1)[1].rstrip("'>\n ")
    reason = one_line(reason)  # it goes into the server's log and the node's row: no line breaks, no escapes
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def train_groups_plain(
    grid,
    server_round: int,
    groups: list[Group],
    timeout: float,
    limits: ReplyLimits,
    check_sum: Callable[[GroupResult], str | None] | None = None,
) -> list[GroupResult]:
    """Train every member of every group at once; return each group's weighted mean of its valid replies (each
    member's weight as the group asked, ``Group.weight_by``, reported by the member, capped at what the group
    allows). Every reply is held to ``limits`` (``common.reply_checks``) and, as a group of one, to the strategy's
    ``check_sum`` (in the clear the server sees who sent a sum it cannot use: that member alone is left out, not its
    group); a bad one is left out with its reason."""
    messages = []
    for group in groups:
        for nid in group.members:
            instruction = train_instruction(group.start[nid], member_config(group, server_round, nid))
            messages.append(
                Message(instruction, dst_node_id=nid, message_type=MessageType.TRAIN, group_id=str(server_round))
            )
    replies = _send(grid, messages, timeout)
    results = []
    for group in groups:
        result = GroupResult(group.name, None, 0.0, [])
        updates, weights = [], []
        cap = max_weight(group, limits.examples_per_round)
        for nid in group.members:
            try:
                arrays, n, metrics, notes = _accept_train_reply(replies[nid], group.reply_reference(nid), cap, limits)
                alone = GroupResult(group.name, arrays, float(n), [nid], metrics={nid: {**metrics, "num_examples": n}})
                if check_sum is not None and (problem := check_sum(alone)):
                    raise ReplyError(f"a sum honest members cannot send: {problem}")
            except Exception as err:  # whatever a reply holds, it costs only this member's contribution
                reason = str(err) if isinstance(err, ReplyError) else f"malformed reply: {err!r}"
                result.rejected[nid] = reason
                log.warning("round %d group %s: reply from node %d rejected: %s", server_round, group.name, nid, reason)
                continue
            for note in notes:
                log.warning("round %d group %s: node %d: %s", server_round, group.name, nid, note)
            updates.append(arrays)
            weights.append(n)
            result.contributors.append(nid)
            result.metrics[nid] = {**metrics, "num_examples": n, "bytes_up": num_bytes(arrays), "robust": notes}
        if updates:
            result.mean = weighted_mean(updates, weights)
            result.total_weight = float(sum(weights))
        results.append(result)
    return results


def _accept_train_reply(
    reply: Message | str, start: Arrays, cap: float, limits: ReplyLimits
) -> tuple[Arrays, int, dict[str, Any], list[str]]:
    """One member's reply held to ``limits``: (update, weight, metrics, what was capped or clipped)."""
    arrays, count, metrics = read_train_reply(_content(reply), start)
    metrics = check_metrics(metrics, limits.train_metrics, limits.optional_metrics)
    n, capped = check_weight(count, cap)
    notes = [f"num_examples {count} capped at {n}"] if capped else []
    if limits.private and limits.clip_norm is not None:  # dp.*: clipped, never refused for its norm, norm not kept
        metrics.pop("update_norm", None)
        metrics.pop("secagg_norm_clipped", None)
        return clip_update(check_update(arrays, start, math.inf), start, limits.clip_norm)[0], n, metrics, notes
    arrays = check_update(arrays, start, limits.max_update_norm)
    # the update's L2 distance from what the member was sent, measured here (the member's own word is replaced):
    # the train row's update_norm, from which robust.max-update-norm can be chosen
    metrics["update_norm"] = update_norm(arrays, start)
    if limits.clip_norm is not None:
        arrays, clipped = clip_update(arrays, start, limits.clip_norm)
        if clipped:
            notes.append(f"update clipped to robust.clip-norm={limits.clip_norm:g}")
    return arrays, n, metrics, notes


def member_config(group: Group, server_round: int, node_id: int, secagg: SecAggPart | None = None) -> dict[str, Any]:
    """A member's train-instruction config (``common.messages``): the round, the strategy's part for the group and
    for the member, how it weighs its update, and differential privacy's and SecAgg+'s parts where the run has them.
    A key two of them set is a strategy's mistake (one would silently win): ValueError naming it and both sources."""
    return encode(
        {
            "the round": RoundPart(server_round=server_round),
            f"group {group.name}": group.config,
            f"node {node_id}'s own": group.member_configs.get(node_id),
            "the weighting": WeightingPart(weight_by=group.weight_by),
            "differential privacy": group.dp,
            "SecAgg+": secagg,
        }
    )


def max_weight(group: Group, examples_per_round: int) -> float:
    """SecAgg+'s ``max_weight`` for a group: the strategy's choice, else what its weighting can reach."""
    if group.max_weight is not None:
        return group.max_weight
    return float(examples_per_round) if group.weight_by == WEIGHT_BY_EXAMPLES else 1.0


def evaluate_nodes(
    grid,
    server_round: int,
    arrays_by_node: dict[int, Arrays],
    timeout: float,
    config_by_node: Mapping[int, Part | None] | None = None,
    max_examples: int | None = None,
    partitions: dict[int, int] | None = None,
) -> dict[int, dict | str]:
    """Federated evaluation: each node evaluates its adapter on its held-out split; metrics or a reason per node.
    ``config_by_node``: the strategy's part of each node's instruction (e.g. the shapes of what ATLAS sends it); a
    reply is refused when it evaluated more than ``max_examples`` or names another partition than ``partitions``
    (node -> the partition it was admitted with) holds for it."""
    messages = [
        Message(
            eval_instruction(arrays, _eval_config(server_round, (config_by_node or {}).get(nid))),
            dst_node_id=nid,
            message_type=MessageType.EVALUATE,
            group_id=f"eval-{server_round}",
        )
        for nid, arrays in arrays_by_node.items()
    ]
    out: dict[int, dict | str] = {}
    for nid, reply in _send(grid, messages, timeout).items():
        try:
            metrics = check_eval_metrics(read_metrics(_content(reply)), max_examples)
            if partitions and nid in partitions and metrics["partition-id"] != partitions[nid]:
                raise ReplyError(f"partition-id {metrics['partition-id']}: admitted as partition {partitions[nid]}")
            out[nid] = metrics
        except Exception as err:  # a bad evaluation reply loses only this node's row
            out[nid] = str(err) if isinstance(err, ReplyError) else f"malformed reply: {err!r}"
            log.warning("round %d: evaluation by node %d failed: %s", server_round, nid, out[nid])
    return out


def _eval_config(server_round: int, part: Part | None) -> dict[str, Any]:
    return encode({"the round": RoundPart(server_round=server_round), "the strategy": part})


def query_clients(
    grid,
    node_ids: list[int],
    timeout: float,
    required: bool = True,
    known: Mapping[str, tuple[str, Arrays]] | None = None,
) -> dict[int, ClientInfo]:
    """Every node's identity (partition id, base model) and initial adapter; nodes that fail are left out (with
    ``required``, at least one must answer).

    The clients of one model build the same seeded adapter, so the query asks each node for its adapter's digest
    only, then fetches the adapter itself from one node per model holding the digest most of them reported (and
    checks it against that digest): 1,000 clients send 1,000 digests and one adapter per model, not 1,000 adapters.
    A node whose digest differs gets no arrays (admission leaves it out). ``known``: model -> (digest, adapter)
    already agreed, for nodes that join later."""
    messages = [
        Message(
            query_instruction(0, QueryPart(query=QUERY_INITIAL, send_adapter=False)),
            dst_node_id=nid,
            message_type=MessageType.QUERY,
        )
        for nid in node_ids
    ]
    answers: dict[int, tuple[int, str, str, Arrays]] = {}  # node -> partition, model, digest, arrays if it sent them
    refusals: Counter[str] = Counter()  # why nodes gave none, so a run that lost many clients says so once
    for nid, reply in _send(grid, messages, timeout).items():
        try:
            arrays, identity = read_initial_reply(_content(reply))
            partition, model = read_identity(identity)
            digest = adapter_digest(arrays) if arrays else str(identity.get(ADAPTER_DIGEST, ""))
            if len(digest) != 64:
                raise ReplyError(f"{ADAPTER_DIGEST} must be a sha256 hex digest, got {digest[:80]!r}")
            answers[nid] = (partition, model, digest, arrays)
        except (ReplyError, KeyError, TypeError, ValueError) as err:
            log.warning("node %d gave no initial adapter: %s", nid, err)
            refusals[_reason(str(err))] += 1
    if refusals:
        reason, count = refusals.most_common(1)[0]
        log.warning(
            "%d of %d nodes gave no initial adapter (%d of them: %s)",
            sum(refusals.values()),
            len(node_ids),
            count,
            reason,
        )
    adapters: dict[str, tuple[str, Arrays]] = {}
    for model in sorted({a[1] for a in answers.values()}):
        holders = {nid: a for nid, a in answers.items() if a[1] == model}
        agreed = (known or {}).get(model) or _fetch_adapter(grid, holders, timeout)
        if agreed is not None:
            adapters[model] = agreed
    clients: dict[int, ClientInfo] = {}
    for nid, (partition, model, digest, _) in answers.items():
        agreed_digest, arrays = adapters.get(model, ("", {}))
        clients[nid] = ClientInfo(nid, partition, model, arrays if digest == agreed_digest else {}, digest)
    if required and not clients:
        why = f": {refusals.most_common(1)[0][0]}" if refusals else ""
        raise RuntimeError(f"no client returned an initial adapter{why}")
    return clients


def _reason(error: str) -> str:
    """An error without its numbers, so that one cause met by many nodes counts once ("partition 7 has 1 examples"
    and "partition 9 has 1 examples" are one reason)."""
    return re.sub(r"\d+", "N", error)


def _fetch_adapter(grid, holders: dict[int, tuple[int, str, str, Arrays]], timeout: float) -> tuple[str, Arrays] | None:
    """The adapter behind the digest most of ``holders`` reported, from the first of them whose arrays match it."""
    digest = Counter(a[2] for a in holders.values()).most_common(1)[0][0]
    for nid in sorted(n for n, a in holders.items() if a[2] == digest):
        arrays = holders[nid][3]
        if not arrays:
            content = query_instruction(0, QueryPart(query=QUERY_INITIAL, send_adapter=True))
            replies = _send(grid, [Message(content, dst_node_id=nid, message_type=MessageType.QUERY)], timeout)
            try:
                arrays = read_initial_reply(_content(replies[nid]))[0] if nid in replies else {}
            except (ReplyError, KeyError, TypeError, ValueError) as err:
                log.warning("node %d's initial adapter: %s", nid, err)
                continue
        if arrays and adapter_digest(arrays) == digest:
            return digest, arrays
        log.warning("node %d's initial adapter does not match the digest it reported", nid)
    return None


def collect_reports(
    grid, server_round: int, node_ids: list[int], read_report: Callable[[Arrays, dict[str, Any]], Any], timeout: float
) -> tuple[dict[int, Any], dict[int, str], dict[int, int]]:
    """Every node's report for the strategy, its metrics held to a reply's bounds (``check_metrics``) and then
    validated by ``read_report``: the reports, the nodes left out (with the reason) and each report's array bytes."""
    messages = [
        Message(
            query_instruction(server_round, QueryPart(query=QUERY_REPORT)),
            dst_node_id=nid,
            message_type=MessageType.QUERY,
            group_id=f"report-{server_round}",
        )
        for nid in node_ids
    ]
    reports: dict[int, Any] = {}
    rejected: dict[int, str] = {}
    sizes: dict[int, int] = {}
    for nid, reply in _send(grid, messages, timeout).items():
        try:
            arrays, metrics = read_report_reply(_content(reply))
            # the same bounds as a train reply's metrics (a report's text reaches rows, logs and plots)
            reports[nid] = read_report(arrays, check_metrics(metrics, {}))
            sizes[nid] = num_bytes(arrays)
        except (ReplyError, KeyError, TypeError, ValueError) as err:
            rejected[nid] = str(err)
            log.warning("round %d: node %d's report left out: %s", server_round, nid, err)
    return reports, rejected, sizes


def wait_for_nodes(grid, minimum: int, timeout: float) -> list[int]:
    start = time.monotonic()
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() - start > timeout:
            raise RuntimeError(
                f"only {len(nodes)} node(s) connected after {timeout:.0f}s; {minimum} needed "
                "(the larger of min-train-replies and min-available-nodes)"
            )
        time.sleep(1.0)
