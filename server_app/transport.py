"""How a group's mean reaches the server: plain sums in the clear, or Flower's SecAgg+ workflow.

``train_groups_plain`` (all groups' members at once) and ``train_group_secure`` (one group) return
``strategies.GroupResult``s; strategies never see which one ran. Members receive their start adapter and return
the group's ``send_back`` names (all of them, or the routed blocks). Plain mode validates every reply (keys,
shapes, NaN/Inf, num_examples) and leaves bad ones out with a logged reason. Secure mode runs one
``SecAggPlusWorkflow`` for the group with a fresh ``LegacyContext`` whose legacy strategy only selects the group
and captures the unmasked mean; clients refuse to mask a non-finite update, and SecAgg+ treats them as dropped.
``query_clients`` and ``collect_reports`` gather the clients' identities and (for strategies that ask) their
per-round reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from common.config import MODULUS_RANGE, SecAggSection
from common.logs import get_logger
from common.records import (
    QUERY_INITIAL,
    QUERY_REPORT,
    ReplyError,
    check_arrays,
    eval_instruction,
    num_bytes,
    pack,
    query_instruction,
    read_initial_reply,
    read_metrics,
    read_report_reply,
    read_train_reply,
    train_instruction,
    unpack,
)
from common.reply_checks import (
    ReplyLimits,
    check_eval_metrics,
    check_metrics,
    check_update,
    check_weight,
    clip_update,
    masked_weight_problem,
)
from server_app.secure_weights import record_unmasked_weight
from strategies.aggregation import weighted_mean
from strategies.base import (
    MIN_SECURE_GROUP,
    SECAGG_CLIP,
    SECAGG_MAX_WEIGHT,
    WEIGHT_BY,
    WEIGHT_BY_EXAMPLES,
    Arrays,
    ClientInfo,
    Group,
    GroupResult,
)

if TYPE_CHECKING:
    from flwr.server.strategy import Strategy

log = get_logger("tessera.server")


def _send(grid, messages: list[Message], timeout: float) -> dict[int, Message | str]:
    """Send and wait; map every destination to its reply, or to the reason there is none."""
    out: dict[int, Message | str] = {m.metadata.dst_node_id: f"no reply within {timeout:.0f}s" for m in messages}
    replies = grid.send_and_receive(messages, timeout=timeout)
    # by the message it answers (ids are set once sent): the SuperLink itself answers for a node that went offline
    sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
    for reply in replies:
        nid = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        out[nid] = f"client error: {_short_reason(reply.error.reason)}" if reply.has_error() else reply
    return out


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
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def train_groups_plain(
    grid, server_round: int, groups: list[Group], config: dict[str, Any], timeout: float, limits: ReplyLimits
) -> list[GroupResult]:
    """Train every member of every group at once; return each group's weighted mean of its valid replies (each
    member's weight as the group asked, ``Group.weight_by``, reported by the member, capped at what the group
    allows). Every reply is held to ``limits`` (``common.reply_checks``); a bad one is left out with its reason."""
    messages = []
    for group in groups:
        for nid in group.members:
            instruction = train_instruction(group.start[nid], member_config(group, config, nid))
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
    metrics = check_metrics(metrics, limits.train_metrics)
    n, capped = check_weight(count, cap)
    arrays = check_update(arrays, start, limits.max_update_norm)
    notes = [f"num_examples {count} capped at {n}"] if capped else []
    if limits.clip_norm is not None:
        arrays, clipped = clip_update(arrays, start, limits.clip_norm)
        if clipped:
            notes.append(f"update clipped to robust.clip-norm={limits.clip_norm:g}")
    return arrays, n, metrics, notes


def member_config(group: Group, config: dict[str, Any], node_id: int) -> dict[str, Any]:
    """A member's train-instruction config: the round's, the group's, its own, and how it weighs its update."""
    return {**config, **group.config, **group.member_configs.get(node_id, {}), WEIGHT_BY: group.weight_by}


def max_weight(group: Group, examples_per_round: int) -> float:
    """SecAgg+'s ``max_weight`` for a group: the strategy's choice, else what its weighting can reach."""
    if group.max_weight is not None:
        return group.max_weight
    return float(examples_per_round) if group.weight_by == WEIGHT_BY_EXAMPLES else 1.0


def train_groups_secure(
    grid,
    context: Context,
    server_round: int,
    groups: list[Group],
    config: dict[str, Any],
    cfg: SecAggSection,
    limits: ReplyLimits,
) -> list[GroupResult]:
    """``train_group_secure`` for every group, the groups concurrently (one thread each).

    The groups of a round are independent SecAgg+ runs over disjoint members: each ``SecAggPlusWorkflow`` waits on
    its own messages (Flower's grids pull replies by message id, so concurrent callers do not take each other's
    replies) and each client keeps its SecAgg+ state in its own context; so members of different groups train at
    the same time instead of one group after another."""
    if len(groups) <= 1:
        return [train_group_secure(grid, context, server_round, g, config, cfg, limits) for g in groups]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="secagg-group") as pool:
        futures = [pool.submit(train_group_secure, grid, context, server_round, g, config, cfg, limits) for g in groups]
        return [f.result() for f in futures]


def train_group_secure(
    grid,
    context: Context,
    server_round: int,
    group: Group,
    config: dict[str, Any],
    cfg: SecAggSection,
    limits: ReplyLimits,
) -> GroupResult:
    """The same contract as ``train_groups_plain``, for one group, through one run of Flower's SecAgg+ protocol.

    Members mask their update multiplied by weight / ``max_weight(group)`` (members cap it at 1); the server
    unmasks the sum and divides by the sum of the weights, which gives the plain path's weighted mean. The server
    cannot leave one member out after unmasking, so a member whose clear reply fails ``limits`` (metrics, a weight
    over the cap) or whose masked weight differs from its reported one costs the group this round's aggregate
    (the group keeps its start adapter), never the run."""
    from flwr.server import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

    why = secure_group_problem(len(group.members), cfg)
    if why:  # never in the clear instead, never a leaking or failing group: not trained, and said so
        log.error("round %d group %s: %s", server_round, group.name, why)
        return GroupResult(group.name, None, 0.0, [], rejected={nid: why for nid in group.members})
    reference = group.reply_reference(group.members[0])  # what members send back (packed: one vector)
    # members count the values SecAgg+ will clip (it clamps silently): they need its range and this group's weight
    cap = max_weight(group, limits.examples_per_round)
    clip_config = {SECAGG_CLIP: cfg.clipping_range, SECAGG_MAX_WEIGHT: cap}
    capture = _CaptureGroup(grid, context.run_id, group, config, clip_config)
    state = RecordDict(
        {MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: server_round}), MAIN_PARAMS_RECORD: ArrayRecord()}
    )
    legacy = LegacyContext(
        Context(context.run_id, context.node_id, dict(context.node_config), state, dict(context.run_config)),
        # cast: a duck-typed legacy strategy; SecAgg+ only calls configure_fit / aggregate_fit on it.
        strategy=cast("Strategy", capture),
    )
    workflow = SecAggPlusWorkflow(
        num_shares=_as_share_param(cfg.num_shares),
        reconstruction_threshold=_as_share_param(cfg.reconstruction_threshold),
        max_weight=cap,
        clipping_range=cfg.clipping_range,
        quantization_range=cfg.quantization_range,
        timeout=cfg.timeout,
    )
    with record_unmasked_weight() as unmasked:
        workflow(grid, legacy)
    result = GroupResult(group.name, None, 0.0, sorted(capture.metrics), metrics=capture.metrics)
    result.rejected = {nid: "dropped out of SecAgg+" for nid in group.members if nid not in capture.metrics}
    if capture.mean is not None:
        try:
            _check_secure_replies(result, unmasked, cap, cfg, limits)
            if len(capture.mean) != 1:
                raise ReplyError(f"{len(capture.mean)} arrays in the aggregate, expected one packed vector")
            mean = unpack(capture.mean[0], reference)
            check_arrays(mean, reference)
            result.mean = {k: v.astype(np.float32) for k, v in mean.items()}
            result.total_weight = float(sum(m["num_examples"] for m in capture.metrics.values()))
        except ReplyError as err:
            result.mean, result.contributors, result.aggregate_rejected = None, [], str(err)
            log.warning("round %d group %s: secure aggregate rejected: %s", server_round, group.name, err)
    for nid, reason in result.rejected.items():
        log.warning("round %d group %s: node %d left out: %s", server_round, group.name, nid, reason)
    return result


def _check_secure_replies(
    result: GroupResult, unmasked: list[int], cap: float, cfg: SecAggSection, limits: ReplyLimits
) -> None:
    """The clear parts of a secure group's replies held to ``limits`` (a failing member's metrics are dropped and
    its reason recorded), then the weight SecAgg+ unmasked held to the reported ones (``masked_weight_problem``).
    ``ReplyError`` if the aggregate cannot be used: it holds a bad member's update."""
    reported, bad = {}, []
    for nid, member in list(result.metrics.items()):
        try:
            metrics = check_metrics({k: v for k, v in member.items() if k != "num_examples"}, limits.train_metrics)
            count, capped = check_weight(member["num_examples"], cap)
            if capped:
                raise ReplyError(f"num_examples {member['num_examples']} is over the group's cap {cap:g}")
        except ReplyError as err:
            result.metrics[nid] = {}
            result.rejected[nid] = str(err)
            bad.append(nid)
            continue
        result.metrics[nid] = {**metrics, "num_examples": count}
        reported[nid] = count
    if bad:
        raise ReplyError(f"it holds the update of node(s) {', '.join(map(str, bad))}, whose replies were refused")
    if len(unmasked) != 1:
        raise ReplyError("SecAgg+ did not expose the unmasked total weight; the aggregate cannot be checked")
    problem = masked_weight_problem(unmasked[0], reported, cap, cfg.quantization_range, MODULUS_RANGE)
    if problem:
        raise ReplyError(problem)


def secure_group_problem(size: int, cfg: SecAggSection) -> str | None:
    """Why a SecAgg+ group of ``size`` members cannot run with ``cfg`` (None if it can): under 3 members it leaks
    (2: each learns the other's update; 1: the update itself); counts of shares or of the reconstruction threshold
    beyond the group fail inside Flower; the group's quantised sum must stay below the modulus."""
    if size < MIN_SECURE_GROUP:
        return f"secure group of {size} < {MIN_SECURE_GROUP} members is not trained (SecAgg+ would leak)"
    if cfg.num_shares > 1 and cfg.num_shares > size:
        return f"secagg.num-shares={cfg.num_shares:g} exceeds the group's {size} members"
    if cfg.reconstruction_threshold > 1 and cfg.reconstruction_threshold > size:
        return f"secagg.reconstruction-threshold={cfg.reconstruction_threshold:g} exceeds the group's {size} members"
    if size * cfg.quantization_range >= MODULUS_RANGE:
        return f"{size} members x secagg.quantization-range={cfg.quantization_range} overflows SecAgg+'s 2^32 modulus"
    return None


def _as_share_param(value: float) -> int | float:
    """SecAgg+ reads an int as a count and a float as a fraction of the group."""
    return int(value) if value > 1 else float(value)


class _CaptureGroup:
    """A minimal legacy strategy: selects the group's members and captures SecAgg+'s unmasked mean."""

    def __init__(self, grid, run_id: int, group: Group, config: dict[str, Any], extra: dict[str, Any]) -> None:
        from flwr.common import FitIns, ndarrays_to_parameters
        from flwr.server.compat.grid_client_proxy import GridClientProxy

        self.instructions = []  # each member's start adapter packed into one vector (``common.records``)
        for nid in group.members:
            settings = {**member_config(group, config, nid), **extra}
            fit_ins = FitIns(ndarrays_to_parameters([pack(group.start[nid])]), settings)
            self.instructions.append((GridClientProxy(nid, grid, run_id), fit_ins))
        self.mean: list[np.ndarray] | None = None
        self.metrics: dict[int, dict[str, Any]] = {}

    def configure_fit(self, server_round, parameters, client_manager):
        return self.instructions

    def aggregate_fit(self, server_round, results, failures):
        from flwr.common import parameters_to_ndarrays

        for proxy, fitres in results:
            self.metrics[proxy.node_id] = {**fitres.metrics, "num_examples": fitres.num_examples}
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}


def evaluate_nodes(
    grid,
    server_round: int,
    arrays_by_node: dict[int, Arrays],
    config: dict[str, Any],
    timeout: float,
    config_by_node: dict[int, dict[str, Any]] | None = None,
) -> dict[int, dict | str]:
    """Federated evaluation: each node evaluates its adapter on its held-out split; metrics or a reason per node.
    ``config_by_node`` adds to ``config`` per node (e.g. the shapes of what ATLAS sends that node)."""
    messages = [
        Message(
            eval_instruction(arrays, {**config, **(config_by_node or {}).get(nid, {})}),
            dst_node_id=nid,
            message_type=MessageType.EVALUATE,
            group_id=f"eval-{server_round}",
        )
        for nid, arrays in arrays_by_node.items()
    ]
    out: dict[int, dict | str] = {}
    for nid, reply in _send(grid, messages, timeout).items():
        try:
            out[nid] = check_eval_metrics(read_metrics(_content(reply)))
        except Exception as err:  # a bad evaluation reply loses only this node's row
            out[nid] = str(err) if isinstance(err, ReplyError) else f"malformed reply: {err!r}"
            log.warning("round %d: evaluation by node %d failed: %s", server_round, nid, out[nid])
    return out


def query_clients(grid, node_ids: list[int], timeout: float, required: bool = True) -> dict[int, ClientInfo]:
    """Ask every node for its initial adapter and identity (partition id, base model); nodes that fail are left out
    (with ``required``, at least one must answer)."""
    messages = [
        Message(query_instruction(QUERY_INITIAL), dst_node_id=nid, message_type=MessageType.QUERY) for nid in node_ids
    ]
    clients: dict[int, ClientInfo] = {}
    for nid, reply in _send(grid, messages, timeout).items():
        try:
            arrays, identity = read_initial_reply(_content(reply))
            clients[nid] = ClientInfo(
                nid, int(identity.get("partition-id", nid)), str(identity.get("model", "?")), arrays
            )
        except (ReplyError, KeyError, TypeError, ValueError) as err:
            log.warning("node %d gave no initial adapter: %s", nid, err)
    if required and not clients:
        raise RuntimeError("no client returned an initial adapter")
    return clients


def collect_reports(
    grid, server_round: int, node_ids: list[int], read_report: Callable[[Arrays, dict[str, Any]], Any], timeout: float
) -> tuple[dict[int, Any], dict[int, str], dict[int, int]]:
    """Every node's report for the strategy, validated by ``read_report``: the reports, the nodes left out (with
    the reason) and each report's array bytes."""
    messages = [
        Message(
            query_instruction(QUERY_REPORT, {"server-round": server_round}),
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
            reports[nid] = read_report(arrays, metrics)
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
                f"only {len(nodes)} node(s) connected after {timeout:.0f}s; min-train-replies is {minimum}"
            )
        time.sleep(1.0)
