"""The ClientApp's work: query (initial adapter / signature report), train and evaluate, as plain functions
``(Message, Context) -> Message``.

``app.py`` calls them in its own process (simulation) or in the node's long-lived worker (``worker.py``,
deployment). The 4-bit base model is loaded at most once per process (``runtime.get_runtime``) and reused across
rounds and across the virtual clients the process serves; each message swaps the client's adapter state in
(``adapters.py``). Train replies use the FitRes layout so that ``secaggplus_mod`` (in ``app.py``) can mask them.
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext

import numpy as np
from flwr.app import Context, Message

from common.adapters.pqlora import adapters_disabled
from common.config import TrainSection
from common.evaluation import evaluate
from common.logs import get_logger
from common.records import (
    ARRAYS,
    CONFIG,
    QUERY_INITIAL,
    QUERY_REPORT,
    from_array_record,
    initial_reply,
    metrics_reply,
    read_train_instruction,
    report_reply,
    train_reply,
)
from common.signatures import probe_gradient, sanitize_signature
from common.training import batch_loss, round_learning_rate, train_round

from .runtime import ClientRuntime, begin_message, get_runtime

log = get_logger("tessera.client")


def query(msg: Message, context: Context) -> Message:
    """``initial-adapter``: the client's fresh adapter (seeded, identical per model) and identity;
    ``report``: this round's sanitised gradient signature and adapter-block salience (SimGrad)."""
    rt = get_runtime(context)
    config = msg.content.config_records[CONFIG] if CONFIG in msg.content else {}
    kind = config.get("query", QUERY_INITIAL)
    if kind == QUERY_REPORT:
        signature, salience = _signature_report(rt, context, int(config.get("server-round", 0)))
        return Message(report_reply(signature, salience, rt.identity()), reply_to=msg)
    if kind != QUERY_INITIAL:
        raise ValueError(f"unknown query '{kind}'")
    return Message(initial_reply(rt.adapter.initial, rt.identity()), reply_to=msg)


def _signature_report(rt: ClientRuntime, context: Context, server_round: int) -> tuple[np.ndarray, list[float]]:
    cfg = rt.cfg.simgrad
    if rt.adapter.kind != "pqlora":
        raise ValueError(f"signature reports need the PQ-LoRA adapter (strategy simgrad), not {rt.adapter.kind}")
    rng = random.Random(rt.cfg.seed * 7919 + server_round * 31 + rt.partition_id)
    examples = rng.sample(rt.train, min(cfg.probe_examples, len(rt.train)))
    rt.adapter.begin(context, None)
    batch = examples[: rt.cfg.train.batch_size]
    salience = rt.adapter.salience(lambda model: batch_loss(model, rt.tokenizer, batch, rt.cfg.train.max_seq_len))
    probe, tokenizer, own = rt.probe()
    with adapters_disabled(probe) if own else nullcontext():  # the probe is the FROZEN base, the same for everyone
        gradient = probe_gradient(probe, tokenizer, examples, cfg.sketch_buckets, seed=rt.cfg.seed, max_len=rt.cfg.train.max_seq_len)
    noise_rng = np.random.default_rng([rt.cfg.seed, server_round, rt.partition_id])
    signature, ema = sanitize_signature(gradient, rt.adapter.signature_ema(context), cfg.ema_decay, cfg.noise_scale, cfg.keep_fraction, noise_rng)
    rt.adapter.keep_signature_ema(context, ema)
    log.info("node %s (partition %d) round %d: signature %d numbers, salience %s", context.node_id, rt.partition_id, server_round, signature.size, [f"{s:.3g}" for s in salience])
    return signature, salience


def node_train_settings(settings: TrainSection, node_config: dict) -> TrainSection:
    """The run's training settings, with this node's memory budget: node-config ``max-micro-batch`` caps the
    slices a batch goes through in (the update stays the same; a smaller GPU just takes more passes)."""
    if "max-micro-batch" not in node_config:
        return settings
    cap = node_config["max-micro-batch"]
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"node-config max-micro-batch: expected an integer >= 1 (got {cap!r})")
    micro = min(settings.micro_batch_size or settings.batch_size, cap)
    return settings.model_copy(update={"micro_batch_size": micro})


def _active_blocks(config: dict) -> list[int] | None:
    value = str(config.get("active-blocks", "")).strip()
    return [int(b) for b in value.split(",")] if value else None


def train(msg: Message, context: Context) -> Message:
    rt = get_runtime(context)
    arrays, config = read_train_instruction(msg.content, rt.adapter.initial)
    active = _active_blocks(config)
    rt.adapter.begin(context, arrays)
    rt.adapter.prepare_training(active)
    server_round = int(config.get("server-round", 1))
    settings = node_train_settings(rt.cfg.train_settings(), context.node_config)
    lr = round_learning_rate(settings, server_round, int(config.get("num-server-rounds", rt.cfg.num_server_rounds)))
    log.info("node %s (partition %d) round %d: training %d steps, lr %.2e", context.node_id, rt.partition_id, server_round, settings.local_steps, lr)
    metrics = train_round(rt.model, rt.tokenizer, rt.train, settings, lr, seed=rt.cfg.seed * 1000 + server_round * 97 + rt.partition_id)
    updated, adapter_metrics = rt.adapter.outgoing(active)
    if not math.isfinite(metrics["train_loss"]) or not all(np.all(np.isfinite(a)) for a in updated.values()):
        # Never send (or mask, under SecAgg+) a diverged update: the error makes the server leave this node out.
        raise RuntimeError(f"partition {rt.partition_id}: training diverged (loss {metrics['train_loss']})")
    rt.adapter.end(context)
    metrics.update(adapter_metrics)
    metrics.update(rt.identity())
    return Message(train_reply(updated, metrics["train_examples"], metrics), reply_to=msg)


def evaluate_handler(msg: Message, context: Context) -> Message:
    rt = get_runtime(context)
    arrays = from_array_record(msg.content.array_records[ARRAYS], rt.adapter.initial)
    rt.adapter.begin(context, arrays)
    metrics = evaluate(rt.model, rt.tokenizer, rt.test, rt.cfg.eval, rt.cfg.train)
    config = msg.content.config_records[CONFIG] if CONFIG in msg.content else {}
    server_round = int(config.get("server-round", -1))
    log.info("node %s (partition %d) round %s: eval loss %.4f EM %.3f ROUGE-L %.3f", context.node_id, rt.partition_id, server_round, metrics["eval_loss"], metrics["exact_match"], metrics["rouge_l"])
    if rt.adapter.kind == "pqlora":
        rt.adapter.end(context)  # keep the newest global part
        if server_round == rt.cfg.num_server_rounds:  # the client's full adapter (local parts never leave it)
            out = rt.adapter.save(rt.cfg.run_path() / "client-adapters" / f"partition-{rt.partition_id}", rt.model_name)
            metrics["adapter_dir"] = str(out)
    metrics.update(rt.identity())
    return Message(metrics_reply(metrics), reply_to=msg)


HANDLERS = {"query": query, "train": train, "evaluate": evaluate_handler}


def handle(kind: str, msg: Message, context: Context, spawn_seconds: float = 0.0) -> Message:
    """Run the handler for ``kind``; ``spawn_seconds`` is how long the ClientApp process took to reach here
    (reported, plus model start-up, as ``startup-seconds``)."""
    begin_message(spawn_seconds)
    return HANDLERS[kind](msg, context)
