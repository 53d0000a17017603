"""Who takes part (``server_app.admission``): a node's identity and initial adapter are its word, so a bad one
leaves that node out with a reason, never the run and never everyone's start adapter."""

from __future__ import annotations

import numpy as np
import pytest
from test_transport_plain import START, InMemoryGrid

from common.records import ReplyError, initial_reply
from server_app.admission import Admission, initialise_strategy, read_identity
from server_app.transport import query_clients
from strategies.base import ClientInfo
from strategies.fedavg import FedAvg


@pytest.mark.parametrize(
    ("identity", "says"),
    [
        ({"partition-id": 0, "model": "m" * 70_000}, "1..200 characters"),
        ({"partition-id": 0, "model": "m" * 256}, "1..200 characters"),
        ({"partition-id": 0, "model": "a\nb"}, "printable"),
        ({"partition-id": 0, "model": ""}, "1..200"),
        ({"partition-id": 0, "model": 7}, "printable"),
        ({"partition-id": True, "model": "m"}, "partition-id"),
        ({"partition-id": -1, "model": "m"}, "partition-id"),
        ({"partition-id": 2**40, "model": "m"}, "partition-id"),
        ({"model": "m"}, "partition-id"),
    ],
)
def test_a_bad_identity_is_refused_naming_the_field(identity, says):
    with pytest.raises(ReplyError, match=says):
        read_identity(identity)


@pytest.mark.usefixtures("task_identity")  # Messages built outside an app (conftest)
def test_a_node_with_a_bad_identity_is_left_out_and_the_others_answer():
    """A 70,000-character model name used to reach the round-0 checkpoint and kill the run there."""
    grid = InMemoryGrid(
        {
            1: lambda content: initial_reply(START, {"partition-id": 0, "model": "smol"}),
            2: lambda content: initial_reply(START, {"partition-id": 1, "model": "x" * 70_000}),
            3: lambda content: initial_reply(START, {"partition-id": 2, "model": "smol"}),
        }
    )
    clients = query_clients(grid, [1, 2, 3], timeout=1.0)
    assert sorted(clients) == [1, 3] and read_identity({"partition-id": 5, "model": "smol"}) == (5, "smol")


def _poisoned() -> dict[str, np.ndarray]:
    """What one hostile node sent as its initial adapter: huge values and an extra 40 MB array."""
    return {**{k: np.full_like(v, 3e38) for k, v in START.items()}, "extra": np.zeros(10_000_000, np.float32)}


def test_a_poisoned_initial_adapter_does_not_become_the_familys_start():
    """FedAvg adopts the first client's initial adapter as its family's start; clients of one model build the same
    seeded adapter, so the one that differs (here from the lowest node id) is left out and the start is honest."""
    clients = {1: ClientInfo(1, 0, "smol", _poisoned())} | {n: ClientInfo(n, n, "smol", START) for n in (2, 3, 4)}
    kept, left_out = Admission().admit(clients)
    assert sorted(kept) == [2, 3, 4] and "differs" in left_out[1]
    strategy = FedAvg()
    strategy.initialise(kept)
    assert sorted(strategy.eval_arrays(2)) == sorted(START)
    assert all(np.array_equal(strategy.eval_arrays(2)[k], START[k]) for k in START)


def test_clients_of_one_model_that_all_disagree_sit_out_and_the_other_models_go_on():
    """One hostile client of a model with two ties the vote on that model's initial adapter: nothing tells the
    honest one apart, so both are left out with the reason; this used to stop the run of every model."""
    clients = {n: ClientInfo(n, n, "smol", {k: v + n for k, v in START.items()}) for n in (1, 2)}
    clients |= {n: ClientInfo(n, n, "qwen", START) for n in (3, 4, 5)}
    admission = Admission()
    kept, left_out = admission.admit(clients)
    assert sorted(kept) == [3, 4, 5] and sorted(left_out) == [1, 2] and "no majority" in left_out[1]
    assert "smol" not in admission.start_digest  # a later admission with more of its clients may still agree
    assert sorted(admission.admit({6: ClientInfo(6, 6, "smol", START), 7: ClientInfo(7, 7, "smol", START)})[0]) == [
        6,
        7,
    ]


def test_a_node_joining_later_must_bring_the_agreed_initial_adapter():
    admission = Admission()
    admission.admit({n: ClientInfo(n, n, "smol", START) for n in (1, 2, 3)})
    assert admission.admit({9: ClientInfo(9, 9, "smol", _poisoned())})[1]
    assert admission.admit({8: ClientInfo(8, 8, "smol", dict(START))})[1] == {}


def test_in_secure_mode_a_family_too_small_for_secagg_is_left_out_not_the_run():
    """One node naming a model nobody else has used to stop a secure run from starting."""
    clients = {n: ClientInfo(n, n, "smol", START) for n in (1, 2, 3)} | {4: ClientInfo(4, 3, "unique", START)}
    strategy = FedAvg(secure=True)
    kept, left_out = initialise_strategy(strategy, clients, secure=True)
    assert sorted(kept) == [1, 2, 3] and list(left_out) == [4] and "fewer than 3" in left_out[4]
    assert strategy.eval_arrays(1) is not None
    with pytest.raises(ValueError, match="fewer than 3"):  # nothing would remain: the strategy's own refusal
        initialise_strategy(FedAvg(secure=True), {4: clients[4], 5: ClientInfo(5, 5, "other", START)}, secure=True)
    plain = FedAvg()
    assert initialise_strategy(plain, clients, secure=False) == (clients, {})


def test_a_run_dir_that_cannot_be_written_fails_before_any_node_is_asked(tmp_path, monkeypatch):
    """A full or read-only run dir used to be found at the round-0 checkpoint, after a whole evaluation."""
    import errno
    import os as _os

    from flwr.app import Context, RecordDict

    from server_app import app
    from server_app.rundir import RunDirNotWritableError

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_os, "write", full_disk)
    grid = InMemoryGrid({1: lambda content: initial_reply(START, {"partition-id": 0, "model": "m"})})
    context = Context(1, 0, {}, RecordDict(), {"run-dir": str(tmp_path / "run"), "node-wait-timeout": 1.0})
    with pytest.raises(RunDirNotWritableError, match="disk is full"):
        app.run_federation(grid, context)
    assert grid.sent == []


def test_the_server_keeps_an_admitted_clients_identity_not_its_adapter():
    import numpy as np

    from server_app.admission import slim
    from strategies.base import ClientInfo

    info = ClientInfo(7, 3, "smollm2-135m-instruct", {"lora_A": np.ones((8, 576), np.float32)})
    kept = slim(info)
    assert (kept.node_id, kept.partition_id, kept.model) == (7, 3, "smollm2-135m-instruct") and kept.initial == {}
    assert info.initial  # the strategy's copy (what it read in initialise) is not touched


def _honest(partition: int, model: str = "smol", adapter=None):
    adapter = START if adapter is None else adapter

    def answer(content):
        send = bool(content.config_records["config"].get("send-adapter", True))
        return initial_reply(adapter, {"partition-id": partition, "model": model}, send)

    return answer


@pytest.mark.usefixtures("task_identity")
def test_the_server_fetches_one_adapter_per_model_and_digests_from_everyone_else():
    """1,000 clients must not each send their (identical, seeded) initial adapter: every node sends its digest, one
    node per model sends the adapter, checked against that digest; a node that reports the agreed digest but sends
    other arrays is passed over for the next holder."""
    lying = _honest(0)

    def liar(content):  # reports START's digest, then sends something else when asked for the arrays
        if content.config_records["config"].get("send-adapter", True):
            return initial_reply(_poisoned(), {"partition-id": 0, "model": "smol"})
        return lying(content)

    other = {k: v + 1 for k, v in START.items()}
    grid = InMemoryGrid(
        {1: liar, 2: _honest(1), 3: _honest(2), 4: _honest(3, "qwen", other), 5: _honest(4, "qwen", other)}
    )
    clients = query_clients(grid, [1, 2, 3, 4, 5], timeout=1.0)
    with_arrays = [m for m in grid.sent if m.content.config_records["config"].get("send-adapter", True)]
    assert sorted(m.metadata.dst_node_id for m in with_arrays) == [1, 2, 4]  # the liar, then node 2; node 4 for qwen
    assert all(np.array_equal(clients[n].initial[k], START[k]) for n in (1, 2, 3) for k in START)
    assert clients[2].initial is clients[3].initial  # one copy per model, however many clients
    assert all(np.array_equal(clients[5].initial[k], other[k]) for k in START)
    kept, left_out = Admission().admit(clients)
    assert sorted(kept) == [1, 2, 3, 4, 5] and not left_out  # the liar's digest is the agreed one; its arrays unused


@pytest.mark.usefixtures("task_identity")
def test_nodes_left_out_are_counted_with_their_reason_and_a_run_nobody_joins_says_why(caplog):
    """1,000 simulated clients on a bank too small for them lost 400 at admission, one warning each; the count and
    the reason now come in one line, and when every node fails the run's error names the reason."""
    ok = lambda content: initial_reply(START, {"partition-id": 0, "model": "smol"})  # noqa: E731
    grid = InMemoryGrid({1: ok, 2: lambda content: "offline", 3: lambda content: "offline"})
    import logging

    server_log = logging.getLogger("tessera.server")  # it does not propagate: listen on it directly
    server_log.addHandler(caplog.handler)
    try:
        assert sorted(query_clients(grid, [1, 2, 3], timeout=1.0)) == [1]
    finally:
        server_log.removeHandler(caplog.handler)
    assert any("2 of 3 nodes gave no initial adapter (2 of them:" in r.getMessage() for r in caplog.records)
    nobody = InMemoryGrid({2: lambda content: "offline", 3: lambda content: "offline"})
    with pytest.raises(RuntimeError, match="no client returned an initial adapter: .*offline"):
        query_clients(nobody, [2, 3], timeout=1.0, required=True)


def test_with_bound_partitions_a_node_cannot_take_over_an_offline_nodes_partition():
    """Deployment with SuperNode authentication (a node id is its registered key): node 9 claiming partition 1 while
    its owner, node 5, is offline is left out, and a resumed run keeps the binding; without the binding (simulation,
    or SuperNodes without keys, which come back with new ids) the claimant takes the partition, as before."""
    from server_app.app import _checkpoint_meta
    from strategies import load_run_config

    bound = Admission(bind=True)
    kept, _ = bound.admit({5: ClientInfo(5, 1, "smol", START), 6: ClientInfo(6, 2, "smol", dict(START))})
    assert sorted(kept) == [5, 6] and bound.owner == {1: 5, 2: 6}
    _, left_out = bound.admit({9: ClientInfo(9, 1, "smol", dict(START))})  # node 5 offline: nobody live holds it
    assert "bound to node 5" in left_out[9]
    assert bound.admit({5: ClientInfo(5, 1, "smol", dict(START))})[1] == {}  # the owner itself is welcome back

    cfg = load_run_config({"strategy": "fedavg", "robust.bind-partitions": True})
    meta = _checkpoint_meta(cfg, [5, 6], bound)
    resumed = Admission(bind=True)
    resumed.owner = {int(p): n for p, n in meta["partition-owners"].items()}  # as run_federation reads it back
    assert "bound to node 5" in resumed.admit({9: ClientInfo(9, 1, "smol", START)})[1][9]

    free = Admission()
    free.admit({5: ClientInfo(5, 1, "smol", START)})
    assert free.admit({9: ClientInfo(9, 1, "smol", dict(START))})[1] == {}
