"""The per-node model worker (deployment): a real worker process serving the real handlers with a tiny random
model. It keeps the model across messages, carries the client's state both ways, reports handler errors without
dying, and exits when the process that launches ClientApps is gone."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from client_app import app, worker
from common.messages import QUERY_INITIAL, QueryPart, RoundPart
from common.records import (
    eval_instruction,
    query_instruction,
    read_initial_reply,
    read_metrics,
    read_train_reply,
    train_instruction,
)

pytestmark = pytest.mark.usefixtures("task_identity")  # Messages built outside an app (conftest)


@pytest.fixture
def launcher(monkeypatch):
    """A stand-in for the SuperExec: the process whose death must stop the worker."""
    import tempfile

    monkeypatch.setenv("TESSERA_WORKER_DIR", tempfile.mkdtemp(prefix="tw"))  # short: Unix socket paths are <108 bytes
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


ROUND_1 = RoundPart(server_round=1).wire()


def initial_query() -> Message:
    return message(query_instruction(0, QueryPart(query=QUERY_INITIAL)), MessageType.QUERY)


def run_config(tiny_llama_dir, tmp_path, **extra) -> dict:
    return {
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "train.local-steps": 1,
        "train.batch-size": 1,
        "eval.max-examples": 1,
        "eval.max-new-tokens": 2,
        "run-dir": str(tmp_path / "run"),
        **extra,
    }


def message(content: RecordDict, kind: str) -> Message:
    msg = Message(content, dst_node_id=7, message_type=kind)
    msg.metadata.__dict__["_message_id"] = msg.object_id  # as delivered: it has an id to reply to
    return msg


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def test_worker_keeps_the_model_and_the_client_state(tiny_llama_dir, tmp_path, launcher):
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 1, "num-partitions": 2},
        state=RecordDict(),
        run_config=run_config(tiny_llama_dir, tmp_path, strategy="simgrad", **{"pqlora.blocks": 2}),
    )
    context.state["secaggplus.mine"] = ArrayRecord()  # not the app's: must stay as it is
    sock = worker.ensure_worker(launcher.pid, idle_timeout=120)
    assert worker.ensure_worker(launcher.pid, idle_timeout=120) == sock  # the running worker is found, not doubled

    reply = worker.call(sock, "query", initial_query(), context, 1.5)
    initial, identity = read_initial_reply(reply.content)
    assert identity["pid"] != subprocess.os.getpid() and identity["model-loads"] == 1
    assert identity["startup-seconds"] >= 1.5  # this process's age plus the worker's model start-up

    start = {k: v + 0.01 for k, v in initial.items()}
    train_msg = message(train_instruction(start, ROUND_1), MessageType.TRAIN)
    reply = worker.call(sock, "train", train_msg, context, 0.0)
    update, n, metrics = read_train_reply(reply.content, initial)
    assert n >= 1 and np.isfinite(metrics["train_loss"])
    assert metrics["pid"] == identity["pid"] and metrics["model-loads"] == 1  # the same process, the model loaded once
    # the declared client state (PQ-LoRA's and SimGrad's) came back into Flower's context; other keys were left alone
    assert {"pqlora.local", "pqlora.global"} <= set(context.state) and "secaggplus.mine" in context.state
    local_after_train = dict(context.state["pqlora.local"])

    reply = worker.call(
        sock,
        "evaluate",
        message(
            eval_instruction(update | {k: v for k, v in start.items() if k not in update}, ROUND_1),
            MessageType.EVALUATE,
        ),
        context,
        0.0,
    )
    assert np.isfinite(read_metrics(reply.content)["eval_loss"])
    assert set(context.state["pqlora.local"]) == set(local_after_train)


def test_handler_errors_reach_the_clientapp_and_the_worker_keeps_serving(tiny_llama_dir, tmp_path, launcher):
    context = Context(
        run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config=run_config(tiny_llama_dir, tmp_path)
    )
    sock = worker.ensure_worker(launcher.pid, idle_timeout=120)
    nonsense = RecordDict({"config": ConfigRecord({"server-round": 0, "query": "nonsense"})})
    with pytest.raises(worker.WorkerError, match="query key 'query'.*'nonsense'"):
        worker.call(sock, "query", message(nonsense, MessageType.QUERY), context, 0.0)
    reply = worker.call(sock, "query", initial_query(), context, 0.0)
    assert read_initial_reply(reply.content)[0]


def test_a_silent_or_malformed_peer_does_not_stop_the_worker(tiny_llama_dir, tmp_path, launcher):
    """A peer that connects and says nothing used to block every ClientApp of the node; a malformed request used
    to kill the worker. Now the first times out and the second is refused, and the node's messages are served."""
    import socket
    from multiprocessing.connection import Client

    context = Context(
        run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config=run_config(tiny_llama_dir, tmp_path)
    )
    sock = worker.ensure_worker(launcher.pid, idle_timeout=120)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(str(sock))  # and never authenticates
    for bad in [("handle",), "stop", ("handle", "train", "x", b"", 0.0), ("handle", "rm -rf", b"", b"", 0.0)]:
        with Client(str(sock), family="AF_UNIX", authkey=worker._authkey(sock)) as conn:
            conn.send(bad)
    started = time.monotonic()
    reply = worker.call(sock, "query", initial_query(), context, 0.0)
    assert read_initial_reply(reply.content)[0] and worker._listening(sock)
    assert time.monotonic() - started < worker.PEER_TIMEOUT + 60  # served after the silent peer timed out
    silent.close()


def test_worker_exits_when_its_launcher_is_gone(tiny_llama_dir, tmp_path, launcher):
    sock = worker.ensure_worker(launcher.pid, idle_timeout=120)
    assert worker._listening(sock)
    launcher.kill()
    launcher.wait()
    assert wait_until(lambda: not sock.parent.exists(), timeout=120), "the worker outlived its SuperExec"


def test_an_idle_worker_exits_and_the_next_message_starts_another(tiny_llama_dir, tmp_path, launcher):
    """Whenever the idle exit happens (even while a message is on its way: the worker accepts a message or exits,
    under one lock, and a message it did not accept goes to a new worker), every message gets its answer."""
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"worker": "on", "worker-idle-timeout": 1},
        state=RecordDict(),
        run_config=run_config(tiny_llama_dir, tmp_path),
    )
    query = initial_query()
    first = read_initial_reply(app.dispatch("query", query, context).content)[1]
    sock = worker.socket_path(subprocess.os.getppid())
    assert wait_until(lambda: not worker._listening(sock), timeout=120), "the idle worker did not exit"
    second = read_initial_reply(app.dispatch("query", query, context).content)[1]
    assert second["pid"] != first["pid"] and second["model-loads"] == 1


def test_a_worker_directory_that_is_not_private_is_refused(monkeypatch, tmp_path):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="tw"))
    monkeypatch.setenv("TESSERA_WORKER_DIR", str(base))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / f"tessera-workers-{subprocess.os.getuid()}").symlink_to(elsewhere)  # planted: points somewhere else
    with pytest.raises(worker.WorkerError, match="not a private directory") as err:
        worker.ensure_worker(12345, idle_timeout=60)
    assert str(base) not in str(err.value)  # the error reaches the server: the node's paths stay in its log


def test_an_unreachable_worker_is_named_without_its_socket_path(tmp_path):
    sock = tmp_path / "private-name" / "w.sock"
    msg = Message(RecordDict(), dst_node_id=1, message_type=MessageType.QUERY)
    with pytest.raises(worker.WorkerUnavailable) as err:
        worker.call(sock, "query", msg, Context(1, 1, {}, RecordDict(), {}), 0.0)
    assert "private-name" not in str(err.value) and str(tmp_path) not in str(err.value), str(err.value)


def test_worker_mode_is_validated_and_auto_means_deployment_only():
    with pytest.raises(ValueError, match="node-config worker"):
        app.use_worker({"worker": "sometimes"})
    assert app.use_worker({"worker": "on"}) and not app.use_worker({"worker": "off"})
    assert not app.use_worker({})  # pytest is not a per-message flwr-clientapp process


def test_clients_with_different_lora_ranks_share_one_base_model(tiny_llama_dir, tmp_path, monkeypatch):
    """One base model per (model, quantisation, device): a client of rank 2 and one of rank 4 in one process (as
    ATLAS's per-client ranks will be) load it once; each gets its own adapter shapes on top of it."""
    from client_app import runtime

    monkeypatch.setattr(runtime, "_MODELS", {})
    loads = runtime.model_loads

    def context(rank: int) -> Context:
        config = run_config(tiny_llama_dir, tmp_path, **{"lora.r": rank})
        return Context(run_id=1, node_id=rank, node_config={}, state=RecordDict(), run_config=config)

    rank2 = runtime.get_runtime(context(2)).adapter.initial
    rank4 = runtime.get_runtime(context(4)).adapter.initial
    again = runtime.get_runtime(context(2)).adapter.initial
    assert runtime.model_loads == loads + 1 and len(runtime._MODELS) == 1
    assert {v.shape for k, v in rank2.items() if "lora_A" in k} == {(2, 32)}
    assert {v.shape for k, v in rank4.items() if "lora_A" in k} == {(4, 32)}
    assert rank2.keys() == again.keys() and all(np.array_equal(rank2[k], again[k]) for k in rank2)  # same seeded init


def test_a_new_run_with_another_base_model_frees_the_old_one(tiny_llama_dir, tmp_path, monkeypatch):
    """A long-lived node (the model worker) keeps the base models its current run uses and frees the others."""
    from client_app import runtime

    monkeypatch.setattr(runtime, "_MODELS", {})

    def context(run_id: int, quantization: str) -> Context:
        config = run_config(tiny_llama_dir, tmp_path, **{"model.quantization": quantization})
        return Context(run_id=run_id, node_id=7, node_config={}, state=RecordDict(), run_config=config)

    runtime.get_runtime(context(1, "fp32"))
    runtime.get_runtime(context(1, "fp32"))
    runtime.get_runtime(context(2, "bf16"))
    assert [key[1] for key in runtime._MODELS] == ["bf16"]
