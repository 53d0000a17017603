"""The ServerApp: validate the run config, drive rounds, evaluate, write metrics, checkpoint, resume, save.

Each round: nodes that joined since are admitted; strategies that ask get every client's signature report; the
strategy names its groups; every group's mean arrives through the plain or the SecAgg+ transport; the strategy
folds the means in; every node evaluates the adapter it will use; one metrics row per node plus an aggregate row
go to ``metrics.jsonl``; the server state is checkpointed. Round 0 is the evaluation before any
training. With ``resume=true`` a restarted run continues after its last completed round.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.adapters import adapter_kind
from common.config import ConfigError, RunConfig
from common.guard import TRAIN_GUARD_METRICS
from common.logs import get_logger
from common.records import num_bytes
from common.reply_checks import TRAIN_OPTIONAL, ReplyLimits, chosen_max_update_norm, reply_metric_specs
from strategies import Strategy, load_run_config, strategy_spec
from strategies.base import Arrays, ClientInfo, GroupResult

from .admission import Admission, initialise_strategy, log_left_out, slim
from .evaluation import evaluate_round
from .offenders import Offenders, combine, refuse_unsound_sums
from .rundir import CheckpointError, RunDirectory
from .sampling import round_participants
from .secure import train_groups_secure
from .transport import collect_reports, query_clients, train_groups_plain, wait_for_nodes

log = get_logger("tessera.server")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, context)


def run_federation(grid: Grid, context: Context) -> RunDirectory:
    try:
        cfg = load_run_config(dict(context.run_config))  # fails before round 1, naming the key
    except ConfigError as err:
        log.error("%s", err)
        raise
    run = RunDirectory(cfg.run_dir)
    run.check_writable()  # a read-only or full run dir fails here, before any node is asked for anything
    if cfg.resume and not run.has_checkpoint():  # starting over would delete the metrics it means to continue
        log.error("resume=true: no checkpoint in %s; nothing changed (resume=false starts over)", run.checkpoint_dir)
        raise ValueError(
            f"resume=true: no checkpoint in {run.checkpoint_dir}; nothing changed (resume=false starts over)"
        )
    strategy = strategy_spec(cfg.strategy).server.from_config(cfg)
    node_ids = wait_for_nodes(grid, max(cfg.min_train_replies, cfg.min_available_nodes), cfg.node_wait_timeout)
    if cfg.secure and not strategy.aggregates:
        log.info("secure=true: strategy %s sends the server no adapter, so SecAgg+ has nothing to mask", cfg.strategy)
    log.info(
        "strategy=%s secure=%s rounds=%d nodes=%s run-dir=%s",
        cfg.strategy,
        cfg.secure,
        cfg.num_server_rounds,
        node_ids,
        run.path,
    )

    first_round = 1
    admission = Admission(bind=cfg.robust.bind_partitions)
    checkpoint = run.load_checkpoint() if cfg.resume else None
    if checkpoint is not None:  # partitions stay bound to the nodes that held them (robust.bind-partitions)
        admission.owner = {int(p): int(n) for p, n in checkpoint[0].get("partition-owners", {}).items()}
    offenders = Offenders(cfg.robust.exclude_after, cfg.seed)  # who is behind refused secure aggregates
    norm_medians: list[float] = []  # each round's median accepted update norm (robust.auto-norm-multiple)
    queried = query_clients(grid, node_ids, cfg.round_timeout)
    clients, left_out = admission.admit(queried)
    clients, small = initialise_strategy(strategy, clients, cfg.secure)
    clients = {nid: slim(info) for nid, info in clients.items()}
    left_out.update(small)
    log_left_out(left_out)
    if len(clients) < cfg.min_train_replies:
        raise RuntimeError(
            f"only {len(clients)} node(s) can take part, min-train-replies is {cfg.min_train_replies} "
            f"(left out: {left_out or 'none'}; not answering: {sorted(set(node_ids) - set(queried)) or 'none'})"
        )
    log.info("clients: %s", {nid: f"partition {c.partition_id}, {c.model}" for nid, c in sorted(clients.items())})
    refused: set[int] = set(left_out)  # nodes left out, or that joined later and could not take part
    if checkpoint is not None:
        meta, state = checkpoint
        check_resumable(cfg, strategy, meta, state, run.checkpoint_dir)
        strategy.load_state_dict(state)
        first_round = meta["round"] + 1
        run.truncate_metrics_after(meta["round"])
        norm_medians = [r["update_norm_median"] for r in run.read_metrics() if _median_row(r)]
        log.info("resuming after round %d from %s", meta["round"], run.checkpoint_dir)
    else:
        if run.metrics_path.exists():
            run.metrics_path.unlink()  # a fresh run starts a fresh metrics file
        if cfg.eval.initial:
            evaluated = round_participants(cfg, node_ids, clients, 0)[1]
            evaluate_round(grid, cfg, strategy, run, 0, evaluated, {}, time.perf_counter(), _partitions(clients))
        _checkpoint(run, 0, strategy, _checkpoint_meta(cfg, node_ids, admission))

    for server_round in range(first_round, cfg.num_server_rounds + 1):
        started = time.perf_counter()
        connected = sorted(grid.get_node_ids()) or node_ids
        node_ids = _admit_new_nodes(grid, cfg, strategy, clients, refused, connected, admission)
        sampled, evaluated = round_participants(cfg, node_ids, clients, server_round)
        sampled = [n for n in sampled if n not in offenders.excluded]  # repeat offenders train no more
        asked = strategy.report_nodes(server_round, sampled)
        report_rows = _collect_reports(grid, cfg, strategy, server_round, asked) if asked else {}
        bound = chosen_max_update_norm(norm_medians, cfg.robust.auto_norm_multiple, cfg.robust.max_update_norm)
        limits = reply_limits(cfg, bound)
        parts, results = _train_round(grid, context, cfg, strategy, server_round, sampled, offenders, limits)
        accepted = sum(len(r.contributors) for r in results)
        if accepted < cfg.min_train_replies:
            log.error(
                "round %d failed: %d valid replies < min-train-replies=%d (rejected: %s); keeping the previous "
                "adapters",
                server_round,
                accepted,
                cfg.min_train_replies,
                {n: why for r in results for n, why in r.rejected.items()},
            )
            results = [GroupResult(r.name, None, 0.0, [], r.rejected, r.metrics, r.aggregate_rejected) for r in results]
        aggregate_started = time.perf_counter()
        strategy.update(server_round, results)
        aggregate_seconds = time.perf_counter() - aggregate_started
        rows = _train_rows(
            parts, aggregate_seconds, {**adapter_kind(cfg.adapter).reply_metrics, **strategy.reply_metrics}
        )
        rows[None]["max_update_norm"] = bound
        if median := rows[None].get("update_norm_median"):  # the next rounds' bound is chosen from these
            norm_medians.append(median)
        if offenders.excluded:
            rows[None]["excluded"] = {str(n): why for n, why in offenders.excluded.items()}
        for nid, extra in report_rows.items():
            rows.setdefault(nid, {"bytes_up": 0, "bytes_down": 0}).update(extra)
        rows[None].update(strategy.report(), sampled=sampled)
        evaluate_round(grid, cfg, strategy, run, server_round, evaluated, rows, started, _partitions(clients))
        strategy.plot_round(server_round, rows[None], run.path)
        _checkpoint(run, server_round, strategy, _checkpoint_meta(cfg, node_ids, admission))

    adapters = _save_adapters(cfg, strategy, run)
    plot = run.plot_eval_loss()
    strategy.plot_run(run.read_metrics(), run.path)
    log.info("done. metrics: %s | plot: %s | adapter: %s", run.metrics_path, plot, ", ".join(str(a) for a in adapters))
    print(
        f"[tessera] metrics: {run.metrics_path}\n[tessera] plot: {plot}\n"
        f"[tessera] adapter: {', '.join(str(a) for a in adapters)}",
        flush=True,
    )
    return run


def _checkpoint_meta(cfg: RunConfig, node_ids: list[int], admission: Admission | None = None) -> dict[str, Any]:
    """Beside the state: the nodes, the settings it was written with (``check_resumable`` compares them) and which
    node each partition is bound to (``robust.bind-partitions``)."""
    owners = {str(p): n for p, n in admission.owner.items()} if admission else {}
    return {"nodes": node_ids, "settings": cfg.to_flat(), **({"partition-owners": owners} if owners else {})}


def check_resumable(cfg: RunConfig, strategy: Strategy, meta: dict, state: dict[str, Arrays], where) -> None:
    """Refuse a checkpoint written by another strategy, base model or adapter shape, naming what differs (after
    ``strategy.initialise``: its fresh state has this run's shapes)."""
    if meta["strategy"] != strategy.name:
        raise ValueError(
            f"resume: the checkpoint in {where} is for strategy '{meta['strategy']}', not '{strategy.name}'"
        )
    before, now = meta.get("settings", {}), cfg.to_flat()
    adapter_key = adapter_kind(cfg.adapter).section.key
    shape_keys = [k for k in now if k in ("model.name", "model.partition-models") or k.startswith(adapter_key + ".")]
    differ = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in shape_keys if k in before and before[k] != now[k]]
    fresh = strategy.state_dict()
    mismatched = [
        f"{group}/{key} {state[group][key].shape} -> {arrays[key].shape}"
        for group, arrays in fresh.items()
        for key in arrays
        if group in state and key in state[group] and state[group][key].shape != arrays[key].shape
    ]
    models_differ = any(d.startswith("model.") for d in differ)
    if mismatched or models_differ:
        raise ValueError(
            f"resume: the checkpoint in {where} was written with other settings ({'; '.join(differ) or 'unrecorded'})"
            + (f"; adapter shapes differ: {', '.join(mismatched[:3])}" if mismatched else "")
        )


def _checkpoint(run: RunDirectory, server_round: int, strategy: Strategy, meta: dict[str, Any]) -> None:
    """Save this round's state; if the disk refuses, the previous checkpoint stays intact and the run goes on (the
    state is in memory; the next round tries again)."""
    try:
        run.save_checkpoint(server_round, strategy.name, strategy.state_dict(), meta)
    except CheckpointError as err:
        log.error("%s", err)


def _admit_new_nodes(
    grid: Grid,
    cfg: RunConfig,
    strategy: Strategy,
    clients: dict,
    refused: set[int],
    connected: list[int],
    admission: Admission | None = None,
) -> list[int]:
    """This round's nodes: the connected ones the strategy knows. Nodes that connected since (a restarted
    SuperNode comes back with a new node id) are asked for their identity and added to the strategy first; a node
    that does not answer, or that the strategy cannot take, is asked once and then left out for the run."""
    new = [nid for nid in connected if nid not in clients and nid not in refused]
    admission = admission or Admission()
    joined = query_clients(grid, new, cfg.round_timeout, required=False, known=admission.adapters) if new else {}
    refused.update(nid for nid in new if nid not in joined)
    live = set(connected)
    for nid, info in sorted(joined.items()):
        try:
            holder = partition_holder(clients, info.partition_id, live)
            if holder is not None:  # a restarted node's old id is gone; a live one with the same id is a clash
                raise ValueError(f"partition {info.partition_id} is already node {holder}'s (node {nid} claims it)")
            problem = admission.admit({nid: info})[1].get(nid)
            if problem:
                raise ValueError(problem)
            strategy.initialise({nid: info})
            clients[nid] = slim(info)
            log.info("node %d joined: partition %d, %s", nid, info.partition_id, info.model)
        except ValueError as err:
            refused.add(nid)
            log.warning("node %d left out: %s", nid, err)
    return [nid for nid in connected if nid in clients]


def _partitions(clients: dict[int, ClientInfo]) -> dict[int, int]:
    """node id -> the partition it was admitted with (what its evaluation rows say, whatever a reply claims)."""
    return {nid: info.partition_id for nid, info in clients.items()}


def partition_holder(clients: dict[int, ClientInfo], partition_id: int, live: set[int]) -> int | None:
    """The connected node that already holds ``partition_id``, if any."""
    return next((nid for nid, c in clients.items() if c.partition_id == partition_id and nid in live), None)


def _train_config(cfg: RunConfig, server_round: int) -> dict[str, Any]:
    return {"server-round": server_round, "num-server-rounds": cfg.num_server_rounds}


def _collect_reports(
    grid: Grid, cfg: RunConfig, strategy: Strategy, server_round: int, node_ids: list[int]
) -> dict[int | None, dict[str, Any]]:
    """Reports for strategies that ask; malformed ones (and those the strategy leaves out) are logged with a reason."""
    reports, rejected, sizes = collect_reports(grid, server_round, node_ids, strategy.read_report, cfg.round_timeout)
    left_out = strategy.observe_reports(server_round, reports)
    for nid, why in left_out.items():
        log.warning("round %d: node %d's report left out: %s", server_round, nid, why)
    rows: dict[int | None, dict[str, Any]] = {nid: {"report_bytes": size} for nid, size in sizes.items()}
    for nid, why in {**rejected, **left_out}.items():
        rows.setdefault(nid, {})["report_rejected"] = why
    return rows


def _train_round(
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
    config = _train_config(cfg, server_round)
    for group in groups:
        log.info(
            "round %d: training group %s (%d clients)%s",
            server_round,
            group.name,
            len(group.members),
            " via SecAgg+" if cfg.secure and strategy.aggregates else "",
        )
    if secure:  # one SecAgg+ run per group, the groups at once (train_groups_secure)
        results = train_groups_secure(grid, context, server_round, groups, config, cfg.secagg, limits)
    else:
        results = train_groups_plain(grid, server_round, groups, config, cfg.round_timeout, limits, strategy.check_sum)
    for group, result in zip(groups, results):
        for nid in result.metrics:
            sent, received = num_bytes(group.reply_reference(nid)), num_bytes(group.start[nid])
            result.metrics[nid].setdefault("bytes_up", sent)
            result.metrics[nid]["bytes_down"] = received
            # layerwise routing: adapter bytes a member did NOT send because its blocks were inactive
            result.metrics[nid]["routing_bytes_saved"] = received - sent
    refuse_unsound_sums(strategy, server_round, results)
    if secure:
        offenders.observe(server_round, results)
    return results, combine(planned, results)


def _median_row(row: dict[str, Any]) -> bool:
    return row.get("node") is None and row.get("round", 0) > 0 and bool(row.get("update_norm_median"))


def reply_limits(cfg: RunConfig, max_update_norm: float | None = None) -> ReplyLimits:
    """What this run's train replies are held to: the instruction's example budget and ``robust.*`` (the update
    norm bound as chosen for the round, ``chosen_max_update_norm``; default: ``robust.max-update-norm``)."""
    declared = {**adapter_kind(cfg.adapter).reply_metrics, **strategy_spec(cfg.strategy).server.reply_metrics}
    return ReplyLimits(
        examples_per_round=examples_per_round(cfg),
        max_update_norm=max_update_norm or cfg.robust.max_update_norm,
        clip_norm=cfg.robust.clip_norm or None,
        optional_metrics={**TRAIN_OPTIONAL, **reply_metric_specs(declared)},
    )


def examples_per_round(cfg: RunConfig) -> int:
    """The most examples one member trains on in a round: what its weight (``num_examples``) is capped at."""
    train = cfg.train_settings()
    return train.local_steps * train.batch_size * train.grad_accum_steps


def _train_rows(
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


# what an evaluation reply adds to its node's metrics row: these always (None when absent) ...
def _save_adapters(cfg: RunConfig, strategy: Strategy, run: RunDirectory) -> list:
    """The strategy's final adapters, each written the way its adapter kind saves a server copy (PEFT for LoRA)."""
    kind = adapter_kind(cfg.adapter)
    return [
        kind.save_server_copy(a.arrays, cfg, a.base_model, run.adapter_dir(a.name)) for a in strategy.final_adapters()
    ]
