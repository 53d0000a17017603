"""A client's state on the node's disk (client_app/state_store.py): what is written (the declared keys only, never
SecAgg+'s), when it is read back (a fresh SuperNode in the same run, or a run that resumes it; not a fresh run),
and that a failed write leaves the previous file whole."""

from __future__ import annotations

import os

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from client_app.state_store import restore, save, state_file

KEYS = ("lora.personal", "simgrad.signature-ema")


def context(tmp_path, run_id: int = 7, resume: bool = False, partition: int = 2) -> Context:
    node_config = {"partition-id": partition, "num-partitions": 3, "state-dir": str(tmp_path / "state")}
    run_config = {"run-dir": "runs/x", "strategy": "fedavg-dual", "resume": resume}
    return Context(run_id, 1, node_config, RecordDict(), run_config)


def filled(ctx: Context) -> Context:
    ctx.state["lora.personal"] = ArrayRecord({"a": Array(np.arange(6, dtype=np.float32).reshape(2, 3))})
    ctx.state["simgrad.signature-ema"] = ArrayRecord({"ema": Array(np.ones(4, dtype=np.float32))})
    ctx.state["secaggplus"] = ConfigRecord({"sk": b"secret"})  # SecAgg+'s round secrets: never on disk
    return ctx


def test_a_restarted_node_reads_back_exactly_the_declared_state(tmp_path):
    before = filled(context(tmp_path, run_id=2**63 + 5))  # Flower's run ids are uint64
    path = state_file(before)
    written = save(before, KEYS, path)
    assert path.parent.parent == tmp_path / "state" and path.name == "partition-2.pb" and written
    assert b"secret" not in path.read_bytes()
    after = context(tmp_path, run_id=2**63 + 5)  # the same run, a fresh SuperNode: empty state
    assert restore(after, KEYS, path) == written
    for key in KEYS:
        for name, array in before.state[key].items():
            np.testing.assert_array_equal(after.state[key][name].numpy(), array.numpy())
    assert "secaggplus" not in after.state
    assert restore(after, KEYS, path) == ""  # a node that has its state keeps it


def test_a_fresh_run_starts_fresh_and_a_resumed_one_continues(tmp_path):
    path = state_file(filled(context(tmp_path)))
    save(filled(context(tmp_path)), KEYS, path)
    fresh = context(tmp_path, run_id=8)  # another Flower run on the same run-dir, resume=false
    assert restore(fresh, KEYS, path) == "" and not any(k in fresh.state for k in KEYS)
    resumed = context(tmp_path, run_id=8, resume=True)  # resume=true: a new Flower run continues the old one
    assert restore(resumed, KEYS, path) and all(k in resumed.state for k in KEYS)
    other = context(tmp_path, partition=0)
    assert state_file(other) != path  # keyed by partition (and by run-dir and strategy)


def test_a_failed_write_leaves_the_previous_state_whole_and_the_message_goes_on(tmp_path, monkeypatch):
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tessera.client").addHandler(handler)
    ctx = filled(context(tmp_path))
    path = state_file(ctx)
    save(ctx, KEYS, path)
    good = path.read_bytes()
    ctx.state["lora.personal"] = ArrayRecord({"a": Array(np.zeros((2, 3), dtype=np.float32))})

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    assert save(ctx, KEYS, path) == ""  # no copy on disk this time; the caller's message is not failed
    assert path.read_bytes() == good and list(path.parent.iterdir()) == [path]  # no temporary file left
    logging.getLogger("tessera.client").removeHandler(handler)
    assert len(said) == 1 and "No space left" in said[0]  # said on the node's log


def test_the_default_directory_is_the_node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    ctx = context(tmp_path)
    del ctx.node_config["state-dir"]
    assert state_file(ctx).is_relative_to(tmp_path / "cache" / "client-state")  # a SuperNode (no Ray here)


def test_a_message_validates_its_run_config_once(tmp_path, monkeypatch):
    """The state keys (read before and after the handler) and the runtime share one validated run config per
    message; the next message validates again."""
    from client_app import runtime

    monkeypatch.setattr(runtime, "_startup", {"spawn": 0.0, "began": 0.0, "ready": 0.0})
    monkeypatch.setattr(runtime, "_validated", {})
    validated = []
    real = runtime.load_run_config
    monkeypatch.setattr(runtime, "load_run_config", lambda flat: validated.append(flat) or real(flat))
    ctx = context(tmp_path)
    runtime.begin_message(0.0)
    keys = runtime.declared_state_keys(ctx)
    assert runtime.run_config(ctx) is runtime.run_config(ctx) and runtime.declared_state_keys(ctx) == keys
    assert len(validated) == 1 and keys == ("personal.lora",)
    other = Context(7, 1, ctx.node_config, RecordDict(), {**ctx.run_config, "strategy": "fedavg"})
    assert runtime.run_config(other).strategy == "fedavg" and len(validated) == 2  # another config: validated
    runtime.begin_message(0.0)
    assert runtime.declared_state_keys(ctx) == keys and len(validated) == 3  # the next message validates afresh


def test_the_identity_pairs_each_key_with_its_value():
    """``ClientRuntime.identity`` builds ``common.messages.Identity``: every key carries its own value, and a member
    keeping its evaluation adds no count of its records."""
    from types import SimpleNamespace

    from client_app.runtime import ClientRuntime
    from common.messages import Identity

    fake = SimpleNamespace(
        partition_id=7,
        data=SimpleNamespace(tasks="boolq", counts={"data-train": 3}),
        model_name="smollm2-135m-instruct",
        state=SimpleNamespace(nbytes=lambda: 42),
        keeps_evaluation=False,
    )
    identity = ClientRuntime.identity(fake)  # type: ignore[arg-type]
    assert set(identity) == {*Identity.keys(), "data-train"}
    kept = ClientRuntime.identity(SimpleNamespace(**{**vars(fake), "keeps_evaluation": True}))  # type: ignore[arg-type]
    assert set(kept) == set(Identity.keys())  # a member keeping its evaluation sends no count of its records
    assert identity["partition-id"] == 7 and identity["tasks"] == "boolq" and identity["data-train"] == 3
    assert identity["model"] == "smollm2-135m-instruct" and identity["state-bytes"] == 42
    assert identity["pid"] == os.getpid() and identity["peak-rss-mb"] > 0 and identity["state-restored"] == ""
    assert isinstance(identity["model-loads"], int) and isinstance(identity["startup-seconds"], float)
