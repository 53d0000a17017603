"""The ClientApp: query (initial adapter), train and evaluate handlers.

The 4-bit base model is loaded at most once per process (``runtime.get_runtime``) and reused across rounds and
across the virtual clients the process serves; each message only swaps adapter weights in. Train messages use
the FitIns / FitRes layout so that ``secaggplus_mod`` can mask the reply when the server runs SecAgg+; plain
train messages pass the mod by.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.client.mod import secaggplus_mod
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from common.adapters import get_adapter_arrays, set_adapter_arrays
from common.evaluation import evaluate
from common.logs import get_logger
from common.records import (
    ARRAYS,
    CONFIG,
    from_array_record,
    metrics_reply,
    read_train_instruction,
    to_array_record,
    train_reply,
)
from common.training import round_learning_rate, train_round

from .runtime import get_runtime

log = get_logger("tessera.client")


def secure_aggregation_mod(msg: Message, context: Context, call_next):
    """Route SecAgg+ protocol messages through Flower's ``secaggplus_mod``; plain train messages skip it."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[secure_aggregation_mod])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Return the client's freshly initialised adapter (identical on every client: seeded init)."""
    rt = get_runtime(context)
    return Message(RecordDict({ARRAYS: to_array_record(rt.initial_arrays)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    rt = get_runtime(context)
    arrays, config = read_train_instruction(msg.content, rt.names)
    set_adapter_arrays(rt.model, arrays)
    server_round = int(config.get("server-round", 1))
    lr = round_learning_rate(rt.cfg.train, server_round, int(config.get("num-server-rounds", rt.cfg.num_server_rounds)))
    log.info("node %s (partition %d) round %d: training %d steps, lr %.2e", context.node_id, rt.partition_id, server_round, rt.cfg.train.local_steps, lr)
    metrics = train_round(rt.model, rt.tokenizer, rt.train, rt.cfg.train, lr, seed=rt.cfg.seed * 1000 + server_round * 97 + rt.partition_id)
    updated = get_adapter_arrays(rt.model)
    if not math.isfinite(metrics["train_loss"]) or not all(np.all(np.isfinite(a)) for a in updated.values()):
        # Never send (or mask, under SecAgg+) a diverged update: the error makes the server leave this node out.
        raise RuntimeError(f"partition {rt.partition_id}: training diverged (loss {metrics['train_loss']})")
    metrics.update(rt.identity())
    return Message(train_reply(updated, metrics["train_examples"], metrics), reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    rt = get_runtime(context)
    arrays = from_array_record(msg.content.array_records[ARRAYS], rt.names)
    set_adapter_arrays(rt.model, arrays)
    metrics = evaluate(rt.model, rt.tokenizer, rt.test, rt.cfg.eval, rt.cfg.train)
    server_round = msg.content.config_records[CONFIG].get("server-round", -1) if CONFIG in msg.content else -1
    log.info("node %s (partition %d) round %s: eval loss %.4f EM %.3f ROUGE-L %.3f", context.node_id, rt.partition_id, server_round, metrics["eval_loss"], metrics["exact_match"], metrics["rouge_l"])
    metrics.update(rt.identity())
    return Message(metrics_reply(metrics), reply_to=msg)

