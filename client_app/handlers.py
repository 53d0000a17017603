"""The ClientApp's work: query (initial adapter / strategy report), train and evaluate, as plain functions
``(Message, Context) -> Message``, the same for every strategy and adapter kind.

``app.py`` calls them in its own process (simulation) or in the node's long-lived worker (``worker.py``,
deployment). The 4-bit base model is loaded at most once per process (``runtime.get_runtime``) and reused across
rounds and across the virtual clients the process serves; each message swaps the client's adapter state in
(``common.adapters``); the strategy's client half (``strategies/<name>/client.py``) adds its report, its
post-processing of the update and the member's weight. Train replies use the FitRes layout so that
``secaggplus_mod`` (in ``app.py``) can mask them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message

from common.adapters import ReportsBound
from common.config import TrainSection
from common.dpsgd import private_train_round
from common.evaluation import evaluate
from common.guard import GUARD_STATE_KEY, as_train, snapshot, trained_names
from common.logs import get_logger
from common.messages import QUERY_REPORT, DpPart, Part, SecAggPart, read_evaluate, read_query, read_train
from common.node_config import node_settings
from common.privacy import with_noise
from common.record_privacy import Steps
from common.records import (
    ARRAYS,
    CONFIG,
    initial_reply,
    metrics_reply,
    read_sent_adapter,
    read_train_arrays,
    read_train_config,
    report_reply,
    train_reply,
)
from common.reply_checks import RECORD_DP_WITHHELD, clip_update, update_norm
from common.training import round_learning_rate, train_round
from strategies import strategy_spec
from strategies.client import save_whole_adapter

from . import member_ledger, record_dp
from .do_no_harm import alone_loss, alone_reference, guard_own, keep_better, train_alone
from .kept_evaluation import kept_reply
from .runtime import (
    ClientRuntime,
    begin_message,
    declared_state_keys,
    get_runtime,
    node_train_settings,
    note_restored,
)
from .state_store import restore, save, state_file

log = get_logger("tessera.client")
# under DP-SGD, beside RECORD_DP_WITHHELD: counts of the sampled records, for the node's own log
_RECORD_ONLY_ON_NODE = ("train_loss_tokens", "loss_tokens_per_second", "train_sampled", "train_clipped")


def query(msg: Message, context: Context) -> Message:
    """``initial-adapter``: the client's fresh adapter (seeded, identical per model) and identity;
    ``report``: this round's report from the strategy's client half (e.g. SimGrad's signature and salience)."""
    rt = get_runtime(context)
    at, query_part = read_query(msg.content.config_records[CONFIG] if CONFIG in msg.content else {})
    if query_part.query == QUERY_REPORT:
        if record_dp.node_budget(context, rt.cfg) and (why := record_dp.refusal(rt.cfg)):
            raise ValueError(why)  # a report made from the records outside DP-SGD would leave the node unaccounted
        arrays, metrics = rt.strategy.report(rt, rt.state, at.server_round)
        return Message(report_reply(arrays, {**metrics, **rt.identity()}), reply_to=msg)
    # the server asks one client per model for the arrays themselves
    return Message(initial_reply(rt.adapter.initial, rt.identity(), query_part.send_adapter), reply_to=msg)


def _wire(rt: ClientRuntime) -> type[Part] | None:
    """The run's strategy's part of an instruction (``StrategySpec.wire``)."""
    return strategy_spec(rt.cfg.strategy).wire


def train(msg: Message, context: Context) -> Message:
    rt = get_runtime(context)
    instruction = read_train(read_train_config(msg.content), _wire(rt))
    part = instruction.strategy
    rt.strategy.configure(rt, part)
    arrays = read_train_arrays(msg.content, rt.strategy.wire_reference(rt, part))
    rt.adapter.begin(rt.state, rt.strategy.start(rt, arrays))
    rt.strategy.ready(rt, part, training=True)
    guarded = guard_own(rt)
    rt.adapter.prepare_training()
    server_round = instruction.round.server_round
    settings = node_train_settings(rt.cfg.train_settings(), context.node_config)
    lr = round_learning_rate(settings, server_round, rt.cfg.num_server_rounds)
    log.info(
        "node %s (partition %d) round %d: training %d steps, lr %.2e",
        context.node_id,
        rt.partition_id,
        server_round,
        settings.local_steps,
        lr,
    )
    seed = rt.cfg.seed * 1000 + server_round * 97 + rt.partition_id
    plan = _record_plan(context, rt, settings, server_round)
    if plan is None:
        trained = train_round(
            rt.model, rt.tokenizer, rt.train, settings, lr, seed=seed, lr_groups=rt.adapter.lr_groups()
        )
    else:  # record-level DP-SGD: the member's budget (client_app.record_dp)
        z, clip = plan.z, plan.budget.clip_norm
        trained = private_train_round(
            rt.model, rt.tokenizer, rt.train, settings, lr, plan.q, z, clip, rt.adapter.lr_groups()
        )
    metrics: dict[str, Any] = dict(trained)
    if rt.cfg.guarded and rt.cfg.guard.reference == "own":  # its own adapter, for the next message's guard
        own = rt.state.get(GUARD_STATE_KEY) or {}
        rt.state.put(GUARD_STATE_KEY, snapshot(rt.model, sorted({*own, *trained_names(rt.model)})))
    metrics.update(as_train(guarded))
    updated, adapter_metrics = rt.adapter.outgoing()
    if not math.isfinite(metrics["train_loss"]) or not all(np.all(np.isfinite(a)) for a in updated.values()):
        # Never send (or mask, under SecAgg+, or keep) a diverged update: the error makes the server leave it out.
        raise RuntimeError(f"partition {rt.partition_id}: training diverged (loss {metrics['train_loss']})")
    updated, strategy_metrics = rt.strategy.outgoing(rt, updated)
    rt.adapter.end(rt.state)
    metrics.update(adapter_metrics)
    metrics.update(strategy_metrics)
    metrics.update(rt.identity())
    weight = rt.strategy.member_weight(instruction.weighting.weight_by, metrics)
    received = arrays or {}
    sent = {k: received.get(k, np.zeros_like(v)) for k, v in updated.items()}  # what the update starts from
    if instruction.dp is not None:  # differential privacy: nothing measured on the raw update leaves the node
        updated = private_update(updated, sent, instruction.dp, instruction.secagg, rt.partition_id)
    else:
        # how far the update moved from what was sent (L2): the train row's update_norm (plain mode: the server
        # measures it itself), from which an operator can choose robust.max-update-norm
        metrics["update_norm"] = update_norm(updated, sent)
    if instruction.secagg is not None:
        updated, weight, secure = masked_update(updated, sent, weight, instruction.secagg, instruction.dp is not None)
        if instruction.dp is not None:  # a count over this member's noised share would say what the noise hides
            clamped = secure.pop("secagg_clipped")
            log.info("partition %d: SecAgg+ will clamp %d values of this update", rt.partition_id, clamped)
        metrics.update(secure)
    if (audit_dir := node_settings(context.node_config).audit_dir) is not None:
        keep_audit_copy(Path(audit_dir), server_round, rt.partition_id, updated, weight)
    metrics.update(member_ledger.record(context, server_round, instruction.dp))  # counted before it is sent
    if plan is not None:
        member_ledger.count_steps(context, server_round, Steps(plan.q, plan.z, plan.steps))
        metrics = _withheld_under_dp_sgd(metrics, rt.partition_id) | record_dp.round_metrics(plan)
    if alone_reference(rt.cfg):  # the guard's reference: this round of the local-only baseline, kept on the node
        train_alone(context, rt, server_round, seed)
    return Message(train_reply(updated, weight, metrics), reply_to=msg)


def _record_plan(context: Context, rt: ClientRuntime, settings: TrainSection, server_round: int):
    """This round's DP-SGD when the member (or the run) sets a record-level budget, else None; ``BudgetSpent`` (the
    server logs it and goes on) or ValueError naming the key when it cannot train within it."""
    budget = record_dp.node_budget(context, rt.cfg)
    if budget is None:
        return None
    if why := record_dp.refusal(rt.cfg):
        raise ValueError(why)
    plan = record_dp.plan_round(context, rt.cfg, budget, settings, len(rt.train), server_round)
    log.info(
        "partition %d: DP-SGD at q %.4g, z %.4g, C %g: epsilon %.3f of %g after this round (delta %g, %s budget)",
        rt.partition_id,
        plan.q,
        plan.z,
        budget.clip_norm,
        plan.epsilon_after,
        budget.epsilon,
        budget.delta,
        budget.source,
    )
    return plan


def _withheld_under_dp_sgd(metrics: dict[str, Any], partition_id: int) -> dict[str, Any]:
    """The train metrics without what was computed from the sampled records outside the noised steps (their loss,
    tokens and counts): logged on the node, never sent."""
    kept = {k: v for k, v in metrics.items() if k not in RECORD_DP_WITHHELD and k not in _RECORD_ONLY_ON_NODE}
    log.info(
        "partition %d: DP-SGD round: loss %.4f over %d sampled examples (%d clipped), %d tokens (kept on the node)",
        partition_id,
        metrics["train_loss"],
        metrics.get("train_sampled", 0),
        metrics.get("train_clipped", 0),
        metrics.get("train_tokens", 0),
    )
    return kept


def private_update(
    updated: dict[str, np.ndarray],
    sent: dict[str, np.ndarray],
    dp: DpPart,
    secagg: SecAggPart | None,
    partition_id: int,
) -> dict[str, np.ndarray]:
    """``dp.*`` (``common.privacy``): the update clipped once, to the tighter of ``dp.clip-norm`` and SecAgg+'s norm
    bound, then (distributed mode) this member's share of the noise added before SecAgg+ masks it. Its norm, and
    whether it was clipped, would say what the noise hides: they are logged on the node, never sent."""
    bound = min(dp.clip_norm, secagg.clip_norm) if secagg is not None else dp.clip_norm
    norm = update_norm(updated, sent)
    updated, clipped = clip_update(updated, sent, bound)
    log.info("partition %d: update norm %.4g, clipped to %.4g: %s", partition_id, norm, bound, clipped)
    if dp.noise_std is not None:
        updated = with_noise(updated, dp.noise_std)
    return updated


def masked_update(
    updated: dict[str, np.ndarray], sent: dict[str, np.ndarray], weight: int, secagg: SecAggPart, private: bool
) -> tuple[dict[str, np.ndarray], int, dict[str, int]]:
    """Secure mode, before ``secaggplus_mod`` masks the update: clipped to SecAgg+'s norm bound (the server cannot
    clip what it cannot see, and refuses a mean beyond it; ``private``: already clipped with the DP clip), the weight
    capped at the group's max weight, and the values SecAgg+ will clamp to its range counted. The update, the weight
    and the reply's metrics (``secagg_clipped`` last: under DP the caller logs it instead)."""
    metrics: dict[str, int] = {}
    if not private:
        updated, clipped = clip_update(updated, sent, secagg.clip_norm)
        metrics["secagg_norm_clipped"] = int(clipped)
    # Flower's SecAgg+ only warns when a weight exceeds its max_weight (the quantised sum can then wrap), and the
    # server refuses a group whose reported weight is over it: an honest member caps its own.
    weight = min(weight, int(secagg.max_weight))
    metrics["secagg_clipped"] = secagg_clipped(updated, weight, secagg)
    return updated, weight, metrics


def keep_audit_copy(directory: Path, server_round: int, partition_id: int, arrays: Mapping, weight: int) -> None:
    """Node-config ``audit-dir``: the node keeps exactly what it contributes each round, in the clear, before
    SecAgg+ masks it (``round-<r>-partition-<p>.npz``: the arrays and ``__weight__``). For the node's own audit of
    what left it; the deployment tests use it to check the secure aggregate against the plain one."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"round-{server_round}-partition-{partition_id}.npz"
    with open(directory / f".{target.name}.tmp", "wb") as handle:
        saved: dict[str, Any] = {"__weight__": np.int64(weight), **{k: np.asarray(v) for k, v in arrays.items()}}
        np.savez(handle, **saved)
    os.replace(directory / f".{target.name}.tmp", target)


def secagg_clipped(arrays: dict[str, np.ndarray], weight: int, secagg: SecAggPart) -> int:
    """The values Flower's secaggplus_mod will clip: it scales by weight / max weight (members cap it at 1), then
    clamps to +-clipping range."""
    ratio = min(weight / secagg.max_weight, 1.0)
    limit = secagg.clipping_range
    return int(sum(np.count_nonzero(np.abs(a) * ratio > limit) for a in arrays.values()))


def evaluate_handler(msg: Message, context: Context) -> Message:
    rt = get_runtime(context)
    instruction = read_evaluate(msg.content.config_records[CONFIG] if CONFIG in msg.content else {}, _wire(rt))
    alone = alone_loss(context, rt)  # measured before the strategy's adapter takes the message
    part = instruction.strategy
    rt.strategy.configure(rt, part)
    arrays = read_sent_adapter(msg.content.array_records[ARRAYS], rt.strategy.wire_reference(rt, part))
    rt.adapter.begin(rt.state, rt.strategy.start(rt, arrays))
    rt.strategy.ready(rt, part, training=False)
    guarded = guard_own(rt) or keep_better(context, rt, alone)
    server_round = instruction.round.server_round
    examples = rt.cfg.eval.examples_at(server_round, rt.cfg.num_server_rounds)  # more where verdicts are made
    metrics: dict[str, Any] = dict(evaluate(rt.model, rt.tokenizer, rt.test, rt.cfg.eval, rt.cfg.train, examples))
    metrics.update(guarded)
    log.info(
        "node %s (partition %d) round %s: eval loss %.4f EM %.3f ROUGE-L %.3f",
        context.node_id,
        rt.partition_id,
        server_round,
        metrics["eval_loss"],
        metrics["exact_match"],
        metrics["rouge_l"],
    )
    rt.adapter.end(rt.state)  # keep the newest received part (kinds with client state)
    if server_round == rt.cfg.num_server_rounds:
        private = record_dp.node_budget(context, rt.cfg) is not None  # the bound is made from the records
        if isinstance(rt.adapter, ReportsBound) and not private:  # e.g. SubLoRA's bound, on the training data
            metrics.update(
                rt.adapter.final_report(rt.tokenizer, rt.train, rt.cfg.eval.batch_size, rt.cfg.train.max_seq_len)
            )
            log.info("node %s (partition %d) bound: %s", context.node_id, rt.partition_id, _bound_line(metrics))
        # the client's own copy, where the server's lacks parts, or where the guard kept less than the server's
        out_dir = rt.cfg.run_path() / "client-adapters" / f"partition-{rt.partition_id}"
        kept_own = guarded.get("guard_share", 1.0) < 1.0
        out = save_whole_adapter(rt, out_dir) if kept_own else rt.strategy.save(rt, out_dir)
        if out is not None:  # where it lies is the node's to know: logged here, not sent
            log.info("node %s (partition %d): its adapter is saved in %s", context.node_id, rt.partition_id, out)
    if rt.keeps_evaluation:  # the member's choice (or the run's ask): what it measured stays with it
        kept = {**metrics, **rt.data.counts}
        metrics = kept_reply(kept, rt.cfg.run_path() / "client-evaluation", rt.partition_id, server_round)
    metrics.update(rt.identity())
    return Message(metrics_reply(metrics), reply_to=msg)


def _bound_line(metrics: dict[str, Any]) -> str:
    return (
        f"{metrics['bound_code_bits']} bits ({metrics['bound_raw_bits']} raw), train "
        f"{metrics['bound_train_bits_per_token']:.3f} bits/token -> bound {metrics['bound_bits_per_token']:.3f}, "
        f"top-1 error {metrics['bound_train_top1_error']:.3f} -> bound {metrics['bound_top1_error']:.3f} "
        f"(m = {metrics['bound_examples']})"
    )


HANDLERS = {"query": query, "train": train, "evaluate": evaluate_handler}


def handle(kind: str, msg: Message, context: Context, spawn_seconds: float = 0.0) -> Message:
    """Run the handler for ``kind``; ``spawn_seconds`` is how long the ClientApp process took to reach here
    (reported, plus model start-up, as ``startup-seconds``)."""
    begin_message(spawn_seconds)
    keys, path = declared_state_keys(context), state_file(context)
    note_restored(context, restore(context, keys, path))  # a restarted SuperNode: its state, from the disk
    reply = HANDLERS[kind](msg, context)
    save(context, keys, path)
    return reply
