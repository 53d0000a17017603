"""A group's mean through Flower's SecAgg+ workflow, with what the server can check without seeing one update.

``train_group_secure`` runs one ``SecAggPlusWorkflow`` for a group, with a fresh ``LegacyContext`` whose legacy
strategy only selects the group and captures the unmasked mean. A hostile member controls what it masks, so
(``common.secure_bounds``):

- every reply the workflow receives is screened before Flower adds it (``_ScreenedGrid``): a masked vector of
  another length, array count or dtype is refused and its member treated as dropped out (its masks are removed
  as a dropped member's are); share lists naming nodes outside the group likewise;
- the reconstruction threshold is at least 3, so a group that loses members halts before fewer than 3 finish, and
  the members whose masked vectors were summed are counted again after unmasking;
- the unmasked sum must lie in the box honest members can fill, and the mean within robust.max-update-norm
  (members clip to it before masking) of the members' starts;
- whatever else fails inside Flower's workflow costs the group this round's aggregate, never the run.

A refused aggregate leaves the group's adapter where it was and is named in the round's ``aggregates_rejected``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from common.core_sections import MODULUS_RANGE, SecAggSection
from common.messages import SecAggPart
from common.records import ReplyError, check_arrays, pack, unpack
from common.reply_checks import ReplyLimits, check_metrics, check_weight, masked_weight_problem
from common.secure_bounds import (
    MIN_SECURE_GROUP,
    box_problem,
    distance_problem,
    flower_shares_and_threshold,
    masked_vector_problem,
    reconstruction_threshold,
)
from server_app.secure_weights import Unmasked, record_unmasked
from strategies.base import Group, GroupResult

from .privacy import distance_allowance
from .transport import log, max_weight, member_config

if TYPE_CHECKING:
    from flwr.server.strategy import Strategy
    from flwr.serverapp import Grid


def train_groups_secure(
    grid,
    context: Context,
    server_round: int,
    groups: list[Group],
    cfg: SecAggSection,
    limits: ReplyLimits,
) -> list[GroupResult]:
    """``train_group_secure`` for every group, the groups concurrently (one thread each).

    The groups of a round are independent SecAgg+ runs over disjoint members: each ``SecAggPlusWorkflow`` waits on
    its own messages (Flower's grids pull replies by message id, so concurrent callers do not take each other's
    replies) and each client keeps its SecAgg+ state in its own context; so members of different groups train at
    the same time instead of one group after another."""
    if len(groups) <= 1:
        return [train_group_secure(grid, context, server_round, g, cfg, limits) for g in groups]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="secagg-group") as pool:
        futures = [pool.submit(train_group_secure, grid, context, server_round, g, cfg, limits) for g in groups]
        return [f.result() for f in futures]


def secure_clip_norm(limits: ReplyLimits) -> float:
    """The L2 norm members clip their own update to before masking (the server's bound on the group's mean)."""
    return min(limits.max_update_norm, limits.clip_norm) if limits.clip_norm else limits.max_update_norm


def train_group_secure(
    grid,
    context: Context,
    server_round: int,
    group: Group,
    cfg: SecAggSection,
    limits: ReplyLimits,
) -> GroupResult:
    """The same contract as ``transport.train_groups_plain``, for one group, through one run of Flower's SecAgg+.

    Members mask their update multiplied by weight / ``max_weight(group)`` (members cap it at 1); the server
    unmasks the sum and divides by the sum of the weights, which gives the plain path's weighted mean. A member
    whose masked reply cannot be summed is left out as a dropped member. The server cannot leave one member out
    after unmasking, so a member whose clear reply fails ``limits`` (metrics, a weight over the cap), whose masked
    weight differs from its reported one, or whose masked values leave the bounds honest members keep to, costs
    the group this round's aggregate (the group keeps its start adapter), never the run."""
    from flwr.server import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    why = secure_group_problem(len(group.members), cfg)
    if why:  # never in the clear instead, never a leaking or failing group: not trained, and said so
        log.error("round %d group %s: %s", server_round, group.name, why)
        rejected = {nid: why for nid in group.members}
        return GroupResult(group.name, None, 0.0, [], rejected=rejected, aggregate_rejected=why)
    reference = group.reply_reference(group.members[0])  # what members send back (packed: one vector)
    # members count the values SecAgg+ will clip (it clamps silently) and clip their own update's norm
    cap = max_weight(group, limits.examples_per_round)
    norm = secure_clip_norm(limits)
    bounds = SecAggPart(clipping_range=cfg.clipping_range, max_weight=cap, clip_norm=norm)
    capture = _CaptureGroup(grid, context.run_id, group, server_round, bounds)
    state = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round}),
            MAIN_PARAMS_RECORD: ArrayRecord(),
        }
    )
    legacy = LegacyContext(
        Context(context.run_id, context.node_id, dict(context.node_config), state, dict(context.run_config)),
        # cast: a duck-typed legacy strategy; SecAgg+ only calls configure_fit / aggregate_fit on it.
        strategy=cast("Strategy", capture),
    )
    workflow = SecAggPlusWorkflow(
        num_shares=_as_share_param(cfg.num_shares),
        reconstruction_threshold=reconstruction_threshold(
            len(group.members), cfg.num_shares, cfg.reconstruction_threshold
        ),
        max_weight=cap,
        clipping_range=cfg.clipping_range,
        quantization_range=cfg.quantization_range,
        timeout=cfg.timeout,
    )
    screened = _ScreenedGrid(grid, int(pack(reference).size), group.members, f"round {server_round} group {group.name}")
    failure = None
    with record_unmasked() as unmasked:
        try:
            workflow(cast("Grid", screened), legacy)
        except Exception as err:  # anything a member's messages make Flower raise costs this group's round only
            failure = f"SecAgg+ failed: {err!r}"[:400]
    result = GroupResult(group.name, None, 0.0, sorted(capture.metrics), metrics=capture.metrics)
    absent = "dropped out of SecAgg+" if capture.metrics else "the group's SecAgg+ run did not finish"
    result.rejected = {nid: screened.refused.get(nid, absent) for nid in group.members if nid not in capture.metrics}
    if failure is None and capture.mean is None:
        failure = (
            f"SecAgg+ halted: too few of the {len(group.members)} members stayed connected to finish (it needs "
            f"{workflow.reconstruction_threshold}, never fewer than {MIN_SECURE_GROUP})"
        )
    try:
        if failure is not None:
            raise ReplyError(failure)
        result.mean = _checked_mean(result, capture.mean or [], unmasked, group, reference, cap, norm, cfg, limits)
        result.total_weight = float(sum(m["num_examples"] for m in capture.metrics.values()))
    except ReplyError as err:
        result.mean, result.contributors, result.aggregate_rejected = None, [], str(err)
        log.warning("round %d group %s: secure aggregate rejected: %s", server_round, group.name, err)
    for nid, reason in result.rejected.items():
        log.warning("round %d group %s: node %d left out: %s", server_round, group.name, nid, reason)
    return result


def _checked_mean(
    result: GroupResult,
    mean: list[np.ndarray],
    unmasked: Unmasked,
    group: Group,
    reference: dict[str, np.ndarray],
    cap: float,
    norm: float,
    cfg: SecAggSection,
    limits: ReplyLimits,
) -> dict[str, np.ndarray]:
    """The group's unmasked mean, if it passes every check an honest group passes (``ReplyError`` otherwise)."""
    contributors = len(result.contributors)
    if contributors < MIN_SECURE_GROUP:
        raise ReplyError(f"only {contributors} members' vectors were summed (a secure group needs {MIN_SECURE_GROUP})")
    reported = _check_secure_replies(result, unmasked, cap, cfg, limits)
    problem = box_problem(unmasked.sums[0][0], contributors, cfg.quantization_range) if unmasked.sums else None
    if problem:
        raise ReplyError(problem)
    if len(mean) != 1:
        raise ReplyError(f"{len(mean)} arrays in the aggregate, expected one packed vector")
    arrays = unpack(mean[0], reference)
    check_arrays(arrays, reference)
    # each contributor's weight ratio exactly as SecAgg+ applied it (checked against the unmasked total above)
    ratios = [round(reported[nid] / cap * cfg.quantization_range) / cfg.quantization_range for nid in reported]
    starts = [group.reply_reference(nid) for nid in reported]
    # distributed differential privacy: the members' noise moves the mean too (server_app.privacy)
    allowance = distance_allowance(group, len(reported), sum(int(np.size(v)) for v in reference.values()))
    problem = distance_problem(arrays, starts, ratios, norm + allowance, cfg.clipping_range, cfg.quantization_range)
    if problem:
        raise ReplyError(problem)
    return {k: v.astype(np.float32) for k, v in arrays.items()}


def _check_secure_replies(
    result: GroupResult, unmasked: Unmasked, cap: float, cfg: SecAggSection, limits: ReplyLimits
) -> dict[int, int]:
    """The clear parts of a secure group's replies held to ``limits`` (a failing member's metrics are dropped and
    its reason recorded), then the weight SecAgg+ unmasked held to the reported ones (``masked_weight_problem``).
    Each contributor's weight; ``ReplyError`` if the aggregate cannot be used: it holds a bad member's update."""
    reported, bad = {}, []
    for nid, member in list(result.metrics.items()):
        try:
            sent = {k: v for k, v in member.items() if k != "num_examples"}
            metrics = check_metrics(sent, limits.train_metrics, limits.optional_metrics)
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
    if len(unmasked.weights) != 1:
        raise ReplyError("SecAgg+ did not expose the unmasked total weight; the aggregate cannot be checked")
    problem = masked_weight_problem(unmasked.weights[0], reported, cap, cfg.quantization_range, MODULUS_RANGE)
    if problem:
        raise ReplyError(problem)
    return reported


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
    shares, _ = flower_shares_and_threshold(size, cfg.num_shares, cfg.reconstruction_threshold)
    needed = reconstruction_threshold(size, cfg.num_shares, cfg.reconstruction_threshold)
    if needed > shares or (cfg.num_shares > 1 and needed >= cfg.num_shares):
        return (
            f"secagg.num-shares={cfg.num_shares:g} gives {shares} shares per member, too few for a reconstruction "
            f"threshold of {needed} (at least {MIN_SECURE_GROUP}, so that no group finishes with fewer)"
        )
    if size * cfg.quantization_range >= MODULUS_RANGE:
        return f"{size} members x secagg.quantization-range={cfg.quantization_range} overflows SecAgg+'s 2^32 modulus"
    return None


def _as_share_param(value: float) -> int | float:
    """SecAgg+ reads an int as a count and a float as a fraction of the group."""
    return int(value) if value > 1 else float(value)


class _ScreenedGrid:
    """The grid as one group's SecAgg+ workflow sees it: replies Flower could not sum safely are held back.

    Flower adds masked vectors with ``+`` (another length raises and ends the run, a (1,) vector is broadcast into
    every coordinate) and indexes share lists by the node ids they name. A reply that fails
    ``masked_vector_problem`` or names nodes outside the group is dropped from what the workflow receives, so the
    workflow treats its member as dropped out (``refused``: node id -> reason)."""

    def __init__(self, grid, length: int, members: list[int], label: str) -> None:
        self._grid, self._length, self._members, self._label = grid, length, set(members), label
        self.refused: dict[int, str] = {}

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        kept = []
        for reply in self._grid.send_and_receive(messages, timeout=timeout):
            problem = None if reply.has_error() else self._problem(reply)
            if problem is None:
                kept.append(reply)
                continue
            node = reply.metadata.src_node_id
            self.refused[node] = problem
            log.warning("%s: SecAgg+ reply from node %d refused: %s", self._label, node, problem)
        return kept

    def _problem(self, reply: Message) -> str | None:
        configs = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is None:
            return None
        # each part the reply carries is screened (a reply carrying both is not let through on its first part)
        if Key.MASKED_PARAMETERS in configs:
            problem = masked_vector_problem(cast(list, configs[Key.MASKED_PARAMETERS]), self._length, MODULUS_RANGE)
            if problem is None:
                try:  # the clear FitRes beside the vector: metrics and num_examples the workflow converts
                    import flwr.compat.common.recorddict_compat as compat

                    compat.recorddict_to_fitres(reply.content, True)
                except Exception as err:
                    problem = f"its FitRes cannot be read: {err!r}"[:300]
            if problem is not None:
                return problem
        if Key.NODE_ID_LIST in configs:  # unmask stage: shares of the nodes it names
            nodes, shares = configs.get(Key.NODE_ID_LIST), configs.get(Key.SHARE_LIST)
            if not isinstance(nodes, list) or not isinstance(shares, list) or len(nodes) != len(shares):
                return "its share list does not match its node list"
            if not set(nodes) <= self._members or not all(isinstance(s, bytes) for s in shares):
                return "its share list names nodes outside the group"
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class _CaptureGroup:
    """A minimal legacy strategy: selects the group's members and captures SecAgg+'s unmasked mean."""

    def __init__(self, grid, run_id: int, group: Group, server_round: int, bounds: SecAggPart) -> None:
        from flwr.common import FitIns, ndarrays_to_parameters
        from flwr.server.compat.grid_client_proxy import GridClientProxy

        self.instructions = []  # each member's start adapter packed into one vector (``common.records``)
        for nid in group.members:
            settings = member_config(group, server_round, nid, bounds)
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
