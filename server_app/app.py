"""The ServerApp: validate the run config, drive rounds, evaluate, write metrics, checkpoint, resume, save.

Each round: nodes that joined since are admitted; strategies that ask get every client's signature report; the
strategy names its groups; every group's mean arrives through the plain or the SecAgg+ transport; the strategy
folds the means in; every node evaluates the adapter it will use; one metrics row per node plus an aggregate row
go to ``metrics.jsonl``; the server state is checkpointed. Round 0 is the evaluation before any
training. With ``resume=true`` a restarted run continues after its last completed round.

``run_federation`` is those steps by name: ``start_federation`` (config, run directory, nodes, admission), then
``resume_federation`` or ``round_zero``, ``run_round`` for every round and ``finish_federation``; what a run
carries between them is one ``Federation``. A round's training itself (the transports, reply limits and train
rows) is ``server_app.training``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.adapters import adapter_kind
from common.config import ConfigError, RunConfig
from common.logs import get_logger
from common.reply_checks import chosen_max_update_norm
from strategies import Strategy, load_run_config, strategy_spec
from strategies.base import Arrays, ClientInfo, GroupResult

from . import privacy
from .admission import Admission, initialise_strategy, log_left_out, slim
from .evaluation import evaluate_round, kept_lines
from .ledger import PrivacyLedger
from .offenders import Offenders
from .rundir import CheckpointError, RunDirectory
from .sampling import round_participants
from .training import reply_limits, train_round, train_rows
from .transport import collect_reports, query_clients, wait_for_nodes

log = get_logger("tessera.server")
app = ServerApp()


@dataclass
class Federation:
    """What a run carries from round to round (``run_federation``).

    Attributes:
        cfg, run, strategy: the validated run config, its run directory and the strategy's server half.
        node_ids: the nodes taking part (this round's, after the nodes that joined are admitted).
        clients: node id -> the identity it was admitted with; refused: nodes left out for the run.
        admission: what the first admission agreed on (each model's start, who holds each partition).
        offenders: who is behind refused secure aggregates; norm_medians: each round's median accepted update norm
            (what ``robust.auto-norm-multiple`` chooses the bound from).
        ledger: the run directory's privacy ledger (``server_app.ledger``): every round's release, recorded before
            the round's first instruction goes out; ``dp_noise`` reads it.
    """

    cfg: RunConfig
    run: RunDirectory
    strategy: Strategy
    node_ids: list[int]
    clients: dict[int, ClientInfo]
    refused: set[int]
    admission: Admission
    offenders: Offenders
    ledger: PrivacyLedger
    norm_medians: list[float] = field(default_factory=list)

    @property
    def dp_noise(self) -> list[float]:
        """The noise multiplier of every release of this run so far, redone rounds included (what the accountant
        composes; 0 for a round without ``dp.*``)."""
        return self.ledger.noise_multipliers()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, context)


def run_federation(grid: Grid, context: Context) -> RunDirectory:
    """The whole run: start (or resume after the checkpoint's round, else round 0), every round, finish."""
    fed, checkpoint = start_federation(grid, context)
    first_round = resume_federation(fed, checkpoint) if checkpoint is not None else round_zero(grid, fed)
    for server_round in range(first_round, fed.cfg.num_server_rounds + 1):
        if why := privacy.stop_reason(fed.cfg, fed.dp_noise, server_round):
            log.warning("%s", why)
            print(f"[tessera] {why}", flush=True)
            break
        run_round(grid, context, fed, server_round)
    finish_federation(fed)
    return fed.run


def start_federation(grid: Grid, context: Context) -> tuple[Federation, tuple[dict, dict[str, Arrays]] | None]:
    """Validate the run config, check the run directory, build the strategy, wait for the nodes and admit them;
    with ``resume=true`` also the checkpoint to continue from (its partition owners already bound)."""
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
        "strategy=%s secure=%s rounds=%d nodes=%s run-dir=%s guard=%s",
        cfg.strategy,
        cfg.secure,
        cfg.num_server_rounds,
        node_ids,
        run.path,
        cfg.guarded,
    )
    if why := cfg.unguarded_why():  # the member's protection against training alone is off: say so, and how
        log.warning("guard.enabled=auto: the do-no-harm guard of strategy %s is off: %s", cfg.strategy, why)
    admission = Admission(bind=cfg.robust.bind_partitions)
    checkpoint = run.load_checkpoint() if cfg.resume else None
    if checkpoint is not None:  # partitions stay bound to the nodes that held them (robust.bind-partitions)
        admission.owner = {int(p): int(n) for p, n in checkpoint[0].get("partition-owners", {}).items()}
    offenders = Offenders(cfg.robust.exclude_after, cfg.seed)  # who is behind refused secure aggregates
    clients, left_out = _admit_clients(grid, cfg, strategy, admission, node_ids)
    # a resumed run goes on with the ledger lines of the run it continues; a fresh one starts its own
    ledger = PrivacyLedger(run.path, checkpoint[0].get("ledger-run") if checkpoint is not None else None)
    fed = Federation(cfg, run, strategy, node_ids, clients, set(left_out), admission, offenders, ledger)
    return fed, checkpoint


def _admit_clients(
    grid: Grid, cfg: RunConfig, strategy: Strategy, admission: Admission, node_ids: list[int]
) -> tuple[dict[int, ClientInfo], dict[int, str]]:
    """The nodes that can take part, initialised in the strategy, and those left out (with why); too few fail."""
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
    return clients, left_out


def resume_federation(fed: Federation, checkpoint: tuple[dict, dict[str, Arrays]]) -> int:
    """Continue after the checkpoint's round: its state loaded (refused if written by another strategy or shape),
    later metrics rows dropped, the norm medians read back; the first round to run."""
    meta, state = checkpoint
    check_resumable(fed.cfg, fed.strategy, meta, state, fed.run.checkpoint_dir)
    fed.strategy.load_state_dict(state)
    fed.run.truncate_metrics_after(meta["round"])
    fed.norm_medians = [r["update_norm_median"] for r in fed.run.read_metrics() if _median_row(r)]
    # every round the checkpoint says was done is a release: the ledger holds it (or is made to), never fewer
    fed.ledger.unrecorded(int(meta["round"]), [float(z) for z in meta.get("dp-noise", [])])
    log.info("resuming after round %d from %s", meta["round"], fed.run.checkpoint_dir)
    fed.run.watch(fed.cfg.live_curves, fresh=False)
    return meta["round"] + 1


def round_zero(grid: Grid, fed: Federation) -> int:
    """A fresh start: a fresh metrics file, the evaluation before any training (``eval.initial``) and the round-0
    checkpoint; the first round to run."""
    if fed.run.metrics_path.exists():
        fed.run.metrics_path.unlink()  # a fresh run starts a fresh metrics file
    fed.run.watch(fed.cfg.live_curves, fresh=True)
    if fed.cfg.eval.initial:
        evaluated = round_participants(fed.cfg, fed.node_ids, fed.clients, 0)[1]
        started = time.perf_counter()
        evaluate_round(grid, fed.cfg, fed.strategy, fed.run, 0, evaluated, {}, started, _partitions(fed.clients))
    _checkpoint(fed.run, 0, fed.strategy, _checkpoint_meta(fed.cfg, fed.node_ids, fed.admission, fed.ledger))
    return 1


def run_round(grid: Grid, context: Context, fed: Federation, server_round: int) -> None:
    """One round: nodes that joined admitted, the sample drawn, reports collected where the strategy asks, its
    groups trained and their means folded in, every evaluated node's row written, the round plotted and
    checkpointed."""
    cfg, strategy = fed.cfg, fed.strategy
    started = time.perf_counter()
    connected = sorted(grid.get_node_ids()) or fed.node_ids
    fed.node_ids = _admit_new_nodes(grid, cfg, strategy, fed.clients, fed.refused, connected, fed.admission)
    sampled, evaluated = round_participants(cfg, fed.node_ids, fed.clients, server_round)
    sampled = [n for n in sampled if n not in fed.offenders.excluded]  # repeat offenders train no more
    # write-ahead: the round's release is on disk before its first report or train instruction goes out
    fed.ledger.record(server_round, privacy.noise_multiplier(cfg) if cfg.dp.enabled else 0.0, **privacy.about(cfg))
    asked = strategy.report_nodes(server_round, sampled)
    report_rows = _collect_reports(grid, cfg, strategy, server_round, asked) if asked else {}
    bound = chosen_max_update_norm(fed.norm_medians, cfg.robust.auto_norm_multiple, cfg.robust.max_update_norm)
    limits = reply_limits(cfg, bound)
    parts, results = train_round(grid, context, cfg, strategy, server_round, sampled, fed.offenders, limits)
    results = _without_means_below_quorum(cfg, server_round, results)
    aggregate_started = time.perf_counter()
    strategy.update(server_round, results)
    rows = _round_rows(fed, parts, time.perf_counter() - aggregate_started, bound, report_rows, sampled)
    evaluate_round(grid, cfg, strategy, fed.run, server_round, evaluated, rows, started, _partitions(fed.clients))
    _checkpoint(fed.run, server_round, strategy, _checkpoint_meta(cfg, fed.node_ids, fed.admission, fed.ledger))
    plotted = strategy.plot_round(server_round, rows[None], fed.run.path)  # optional: after the checkpoint
    fed.run.live.add_images(server_round, plotted, fed.run.path)


def _without_means_below_quorum(cfg: RunConfig, server_round: int, results: list[GroupResult]) -> list[GroupResult]:
    """The round's results, or, with fewer valid replies than ``min-train-replies``, the same without their means
    (the round fails, logged: the strategy keeps its previous adapters)."""
    accepted = sum(len(r.contributors) for r in results)
    if accepted < cfg.min_train_replies:
        log.error(
            "round %d failed: %d valid replies < min-train-replies=%d (rejected: %s); keeping the previous adapters",
            server_round,
            accepted,
            cfg.min_train_replies,
            {n: why for r in results for n, why in r.rejected.items()},
        )
        results = [GroupResult(r.name, None, 0.0, [], r.rejected, r.metrics, r.aggregate_rejected) for r in results]
    return results


def _round_rows(
    fed: Federation,
    parts: list[GroupResult],
    aggregate_seconds: float,
    bound: float,
    report_rows: dict[int | None, dict[str, Any]],
    sampled: list[int],
) -> dict[int | None, dict[str, Any]]:
    """The round's train rows (per node and the aggregate, ``None``) with its norm bound, exclusions, reports and
    the strategy's diagnostics; the round's median update norm kept for the next rounds' bound."""
    extra = {**adapter_kind(fed.cfg.adapter).reply_metrics, **fed.strategy.reply_metrics}
    rows = train_rows(parts, aggregate_seconds, extra)
    rows[None]["max_update_norm"] = bound
    if median := rows[None].get("update_norm_median"):  # the next rounds' bound is chosen from these
        fed.norm_medians.append(median)
    if fed.offenders.excluded:
        rows[None]["excluded"] = {str(n): why for n, why in fed.offenders.excluded.items()}
    for nid, extra_row in report_rows.items():
        rows.setdefault(nid, {"bytes_up": 0, "bytes_down": 0}).update(extra_row)
    rows[None].update(fed.strategy.report(), sampled=sampled)
    rows[None].update(privacy.round_row(fed.cfg, fed.dp_noise))
    return rows


def finish_federation(fed: Federation) -> None:
    """Save the strategy's final adapters, plot the run and say where everything is (and, with ``dp.*``, what
    privacy it spent)."""
    adapters = _save_adapters(fed.cfg, fed.strategy, fed.run)
    if fed.cfg.dp.enabled:
        spent = privacy.round_row(fed.cfg, fed.dp_noise)
        line = (
            f"differential privacy ({fed.cfg.dp.mode}): epsilon {spent['dp_epsilon']:.3f} at delta "
            f"{fed.cfg.dp.delta:g} over {len(fed.dp_noise)} release(s) (the ledger: {fed.ledger.path}), clip norm "
            f"{fed.cfg.dp.clip_norm:g}"
        )
        log.info("%s", line)
        print(f"[tessera] {line}", flush=True)
    rows = fed.run.read_metrics()
    for line in [*privacy.record_lines(rows), *kept_lines(rows)]:  # each member's own epsilon; who kept its evaluation
        log.info("%s", line)
        print(f"[tessera] {line}", flush=True)
    plot = fed.run.plot_eval_loss() or "not drawn (see the log)"  # a figure never stops a run (common.plots.drawn)
    fed.strategy.plot_run(rows, fed.run.path)  # logged, never raised (Strategy.__init_subclass__)
    log.info(
        "done. metrics: %s | plot: %s | adapter: %s", fed.run.metrics_path, plot, ", ".join(str(a) for a in adapters)
    )
    print(
        f"[tessera] metrics: {fed.run.metrics_path}\n[tessera] plot: {plot}\n"
        f"[tessera] adapter: {', '.join(str(a) for a in adapters)}",
        flush=True,
    )


def _checkpoint_meta(
    cfg: RunConfig, node_ids: list[int], admission: Admission | None = None, ledger: PrivacyLedger | None = None
) -> dict[str, Any]:
    """Beside the state: the nodes, the settings it was written with (``check_resumable`` compares them), which
    node each partition is bound to (``robust.bind-partitions``), the ledger's run and every release's noise
    multiplier so far (0 for a round without ``dp.*``; the ledger itself is the record)."""
    owners = {str(p): n for p, n in admission.owner.items()} if admission else {}
    meta = {"nodes": node_ids, "settings": cfg.to_flat(), **({"partition-owners": owners} if owners else {})}
    if ledger is None:
        return meta
    return {**meta, "ledger-run": ledger.run, "dp-noise": ledger.noise_multipliers()}


def check_resumable(cfg: RunConfig, strategy: Strategy, meta: dict, state: dict[str, Arrays], where) -> None:
    """Refuse a checkpoint written by another strategy, base model, adapter shape or privacy setting (``dp.*``),
    naming what differs (after ``strategy.initialise``: its fresh state has this run's shapes)."""
    if meta["strategy"] != strategy.name:
        raise ValueError(
            f"resume: the checkpoint in {where} is for strategy '{meta['strategy']}', not '{strategy.name}'"
        )
    before, now = meta.get("settings", {}), cfg.to_flat()
    # the released adapter carries every round before the checkpoint: another dp.* would misstate what it spent
    privacy_differ = [
        f"{k}: {before.get(k, 'unrecorded')!r} -> {now[k]!r}"
        for k in sorted(now)
        if k.startswith("dp.") and before.get(k) != now[k] and (k in before or cfg.dp.enabled)
    ]
    if privacy_differ:
        raise ValueError(
            f"resume: the checkpoint in {where} was written with other privacy settings ({'; '.join(privacy_differ)}): "
            "the rounds it holds were released under those; resume with them, or start over (resume=false)"
        )
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
    # keys this run's state has and the checkpoint lacks: other adapter settings, or an older version of the strategy
    missing = [f"{group}/{key}" for group, arrays in fresh.items() for key in arrays if key not in state.get(group, {})]
    models_differ = any(d.startswith("model.") for d in differ)
    if mismatched or models_differ or missing:
        raise ValueError(
            f"resume: the checkpoint in {where} was written with other settings ({'; '.join(differ) or 'unrecorded'})"
            + (f"; adapter shapes differ: {', '.join(mismatched[:3])}" if mismatched else "")
            + (f"; it lacks {', '.join(missing[:3])} (other adapter settings or an older Tessera)" if missing else "")
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


def _median_row(row: dict[str, Any]) -> bool:
    return row.get("node") is None and row.get("round", 0) > 0 and bool(row.get("update_norm_median"))


def _save_adapters(cfg: RunConfig, strategy: Strategy, run: RunDirectory) -> list:
    """The strategy's final adapters, each written the way its adapter kind saves a server copy (PEFT for LoRA); one
    whose directory another already has is refused and logged, never written over it (``RunDirectory.adapter_dirs``)."""
    kind = adapter_kind(cfg.adapter)
    final = strategy.final_adapters()
    targets = run.adapter_dirs([a.name for a in final])
    return [kind.save_server_copy(a.arrays, cfg, a.base_model, targets[i]) for i, a in enumerate(final) if i in targets]
