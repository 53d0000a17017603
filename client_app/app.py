"""The ClientApp: Flower's entry point, kept thin (Flower and numpy only; no torch at import).

Every message goes to ``handlers.handle``: in this process (simulation, where Ray keeps the process and its
model across rounds), or in the node's long-lived model worker (``worker.py``) when Flower started this process
for this one message (deployment: ``flwr-clientapp``), so that the model is not re-imported and re-quantised
every round. Node-config ``worker`` = ``auto`` (default) | ``on`` | ``off`` chooses; ``worker-idle-timeout``
(seconds, default 1800) is how long an unused worker keeps the model.

SecAgg+ runs here, around the handler: train replies use the FitRes layout so that ``secaggplus_mod`` can mask
them; plain train messages pass the mod by.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from common.node_config import node_settings


def secure_aggregation_mod(msg: Message, context: Context, call_next):
    """Route SecAgg+ protocol messages through Flower's ``secaggplus_mod``; plain train messages skip it."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[secure_aggregation_mod])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """``initial-adapter``: the client's fresh adapter and identity; ``report``: its SimGrad signature report."""
    return dispatch("query", msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return dispatch("train", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return dispatch("evaluate", msg, context)


def per_message_process() -> bool:
    """True when Flower started this process for one message (deployment's ``flwr-clientapp``)."""
    return Path(sys.argv[0]).name == "flwr-clientapp"


def use_worker(node_config: Mapping[str, Any]) -> bool:
    mode = node_settings(node_config).worker
    return mode == "on" or (mode == "auto" and per_message_process())


def dispatch(kind: str, msg: Message, context: Context) -> Message:
    spawn_seconds = _process_age() if per_message_process() else 0.0
    if use_worker(context.node_config):
        from . import worker

        idle_timeout = node_settings(context.node_config).worker_idle_timeout
        for attempt in (1, 2):  # a worker that exited (idle) between our check and our request: start one, once
            sock = worker.ensure_worker(os.getppid(), idle_timeout)  # parent = the SuperExec that launches ClientApps
            try:
                return worker.call(sock, kind, msg, context, spawn_seconds)
            except worker.WorkerUnavailable:
                if attempt == 2:
                    raise
    from .handlers import handle

    return handle(kind, msg, context, spawn_seconds)


def _process_age() -> float:
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())
