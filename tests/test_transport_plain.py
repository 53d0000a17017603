"""The plain transport keeps the round going when some replies are bad (a tiny in-memory Grid stands in for
the SuperLink here; the real one runs in the e2e tests)."""

import logging

import numpy as np
import pytest
from flwr.app import Error, Message, RecordDict

from common.records import read_train_instruction, report_reply, train_reply
from common.reply_checks import ReplyLimits
from server_app.transport import collect_reports, train_groups_plain
from strategies import load_run_config
from strategies.aggregation import weighted_mean
from strategies.base import ClientInfo, Group
from strategies.simgrad import SimGrad, SimGradSection
from strategies.simgrad.wire import SimGradWire

pytestmark = pytest.mark.usefixtures("task_identity")  # Messages built outside an app (conftest)


# what every train reply carries (common.reply_checks.TRAIN_METRICS), and the round's limits
METRICS = {"train_loss": 1.0, "train_tokens": 10, "train_seconds": 1.0, "tokens_per_second": 10.0, "partition-id": 0}
LIMITS = ReplyLimits(examples_per_round=100)
START = {"w.lora_A.weight": np.zeros((2, 3), np.float32), "w.lora_B.weight": np.zeros((3, 2), np.float32)}


class InMemoryGrid:
    """Answers each message with ``behaviour[node](arrays)``: a reply RecordDict, an Error, or None (no reply)."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.sent = []

    def send_and_receive(self, messages, *, timeout=None):
        self.batches = getattr(self, "batches", 0) + 1
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id  # as Flower's grid does when it pushes
            self.sent.append(msg)
            nid = msg.metadata.dst_node_id
            if "fitins.parameters" in msg.content:
                arrays, config = read_train_instruction(msg.content, START)
                out = (
                    self.behaviour[nid](arrays, config)
                    if "config" in self.behaviour[nid].__code__.co_varnames
                    else self.behaviour[nid](arrays)
                )
            else:
                out = self.behaviour[nid](msg.content)
            if out is None:
                continue
            if (
                isinstance(out, str) and out == "offline"
            ):  # the SuperLink answers for a node that stopped sending heartbeats
                from flwr.app import Error

                reply = Message(
                    Error(code=5, reason="The node is offline: no heartbeat within 2 x its interval."), reply_to=msg
                )
                reply.metadata.__dict__["_src_node_id"] = 0  # from the SuperLink, not the node
            else:
                reply = Message(out, reply_to=msg)
            replies.append(reply)
        return replies


def good(value, n):
    return lambda arrays: train_reply({k: v + value for k, v in arrays.items()}, n, METRICS)


def test_bad_replies_are_left_out_and_the_rest_aggregated(caplog):
    behaviour = {
        1: good(1.0, 10),
        2: good(3.0, 30),
        3: lambda a: train_reply({**a, "w.lora_A.weight": np.full((2, 3), np.nan, np.float32)}, 5, METRICS),  # NaN
        4: lambda a: train_reply({**a, "w.lora_B.weight": np.zeros((4, 4), np.float32)}, 5, METRICS),  # wrong shape
        5: lambda a: train_reply({"w.lora_A.weight": a["w.lora_A.weight"]}, 5, METRICS),  # missing key
        6: lambda a: Error(code=0, reason="client crashed"),
        7: lambda a: None,  # never answers
        8: lambda a: "offline",  # killed: the SuperLink answers for it
    }
    grid = InMemoryGrid(behaviour)
    group = Group("all", {nid: START for nid in behaviour})
    server_log = logging.getLogger("tessera.server")  # it does not propagate to the root logger caplog watches
    server_log.addHandler(caplog.handler)
    try:
        (result,) = train_groups_plain(grid, 1, [group], timeout=1.0, limits=LIMITS)
    finally:
        server_log.removeHandler(caplog.handler)
    assert result.contributors == [1, 2]
    assert set(result.rejected) == {3, 4, 5, 6, 7, 8}
    assert "NaN" in result.rejected[3] and "layout" in result.rejected[4] and "layout" in result.rejected[5]
    assert "crashed" in result.rejected[6] and "no reply" in result.rejected[7] and "offline" in result.rejected[8]
    expected = weighted_mean([{k: v + 1.0 for k, v in START.items()}, {k: v + 3.0 for k, v in START.items()}], [10, 30])
    for key in START:
        np.testing.assert_allclose(result.mean[key], expected[key])
        np.testing.assert_allclose(result.mean[key], 2.5)  # (10 * 1 + 30 * 3) / 40
    assert result.total_weight == 40
    assert sum("rejected" in rec.message for rec in caplog.records) == 6


def test_all_bad_gives_no_mean():
    grid = InMemoryGrid({1: lambda a: None, 2: lambda a: Error(code=0, reason="x")})
    (result,) = train_groups_plain(grid, 2, [Group("all", {1: START, 2: START})], timeout=1.0, limits=LIMITS)
    assert result.mean is None and result.contributors == []


def test_groups_train_in_one_batch_and_return_only_their_send_back_names():
    """Several groups (SimGrad plain mode: one per client) go out together; each member returns only the arrays
    its group asked for (layerwise routing) and the group's config reaches it."""
    seen = {}

    def routed(nid):
        def reply(arrays, config):
            seen[nid] = config["active-blocks"]
            return train_reply({"w.lora_A.weight": arrays["w.lora_A.weight"] + nid}, 4, METRICS)

        return reply

    grid = InMemoryGrid({1: routed(1), 2: routed(2), 3: lambda a: train_reply(a, 4, METRICS)})  # 3 sends too much
    groups = [
        Group(f"p{n}", {n: START}, send_back=["w.lora_A.weight"], config=SimGradWire(active_blocks=(0,)))
        for n in (1, 2, 3)
    ]
    results = train_groups_plain(grid, 1, groups, timeout=1.0, limits=LIMITS)
    assert grid.batches == 1 and seen == {1: "0", 2: "0"}
    assert [sorted(r.mean) if r.mean else None for r in results] == [["w.lora_A.weight"], ["w.lora_A.weight"], None]
    np.testing.assert_allclose(results[1].mean["w.lora_A.weight"], 2.0)
    assert "layout" in results[2].rejected[3]  # it sent every array, the group asked for one


def test_malformed_signatures_are_left_out_of_the_relevance_matrix_with_a_reason(caplog):
    good_sig = np.ones(12, np.float32)
    behaviour = {
        1: lambda content: signature_report(good_sig, [0.1, 0.2]),
        2: lambda content: signature_report(good_sig * 2, [0.3, 0.0]),
        3: lambda content: signature_report(np.full(12, np.nan, np.float32), [0.1, 0.1]),  # NaN
        4: lambda content: signature_report(np.zeros(12, np.float32), [0.1, 0.1]),  # all zeros
        5: lambda content: signature_report(np.ones(7, np.float32), [0.1, 0.1]),  # another probe's length
        6: lambda content: signature_report(good_sig, [0.1]),  # salience for the wrong number of blocks
        7: lambda content: RecordDict(),  # no report at all
        8: lambda content: report_reply({"sig": good_sig}, {"salience": [0.1, 0.1]}),  # not a signature
        9: lambda content: signature_report(np.full(12, 1e30, np.float32), [0.1, 0.1]),  # huge: NaN relevance before
        10: lambda content: signature_report(np.full(12, 1e39, np.float64), [0.1, 0.1]),  # beyond float32
    }
    strategy = SimGrad(SimGradSection())
    two_blocks = {
        f"block{b}.q_proj.{k}": np.zeros((2, 2) if k == "P" else (2,), np.float32) for b in (0, 1) for k in "PQ"
    }
    strategy.initialise({n: ClientInfo(n, n, "m", two_blocks) for n in behaviour})
    server_log = logging.getLogger("tessera.server")
    server_log.addHandler(caplog.handler)
    try:
        reports, rejected, sizes = collect_reports(
            InMemoryGrid(behaviour), 1, sorted(behaviour), strategy.read_report, 1.0
        )
        left_out = strategy.observe_reports(1, reports)
    finally:
        server_log.removeHandler(caplog.handler)
    assert sorted(reports) == [1, 2, 5] and sorted(rejected) == [3, 4, 6, 7, 8, 9, 10]
    assert "within" in rejected[9] and "Inf" in rejected[10]
    assert "NaN" in rejected[3] and "zeros" in rejected[4] and "salience" in rejected[6]
    assert "report" in rejected[7] and "signature" in rejected[8]
    assert list(left_out) == [5] and "7 numbers" in left_out[5]  # the majority's signature length wins
    assert strategy.report()["relevance_nodes"] == [1, 2]
    np.testing.assert_allclose(reports[2].salience, [0.3, 0.0])
    assert sizes[1] == good_sig.nbytes
    assert sum("report left out" in rec.message for rec in caplog.records) == 7
    assert np.all(np.isfinite(strategy.report()["relevance_weights"]))


def signature_report(signature, salience):
    return report_reply({"signature": signature}, {"salience": salience})


def test_a_late_node_that_does_not_answer_is_asked_once():
    """A node that connects mid-run is asked for its identity before it trains; one that stays silent is not
    asked again every round (each ask waits up to round-timeout)."""
    from common.records import initial_reply
    from server_app.app import _admit_new_nodes
    from strategies.fedavg import FedAvg

    grid = InMemoryGrid(
        {3: lambda content: initial_reply(START, {"partition-id": 2, "model": "m"}), 4: lambda content: None}
    )
    strategy, clients, refused = FedAvg(), {}, set()
    strategy.initialise({1: ClientInfo(1, 0, "m", START)})
    clients[1] = ClientInfo(1, 0, "m", START)
    cfg = load_run_config({"round-timeout": 1.0})
    assert _admit_new_nodes(grid, cfg, strategy, clients, refused, [1, 3, 4]) == [1, 3]
    assert refused == {4} and clients[3].partition_id == 2
    asked = len(grid.sent)
    assert _admit_new_nodes(grid, cfg, strategy, clients, refused, [1, 3, 4]) == [1, 3]
    assert len(grid.sent) == asked  # nobody asked again


def test_fedavg_equals_flowers_own_fedavg_on_the_same_replies():
    """Our FedAvg (plain transport + strategy) and Flower's ``flwr.serverapp.strategy.FedAvg.aggregate_train`` agree
    on the same client updates and example counts."""
    from flwr.app import ArrayRecord, MessageType, MetricRecord
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    from strategies.fedavg import FedAvg

    rng = np.random.default_rng(0)
    updates = {nid: {k: rng.normal(size=v.shape).astype(np.float32) for k, v in START.items()} for nid in (1, 2, 3)}
    examples = {1: 8, 2: 24, 3: 40}
    ours = FedAvg()
    ours.initialise({nid: ClientInfo(nid, nid, "m", START) for nid in updates})
    grid = InMemoryGrid(
        {nid: (lambda a, nid=nid: train_reply(updates[nid], examples[nid], METRICS)) for nid in updates}
    )
    ours.update(1, train_groups_plain(grid, 1, ours.train_groups(1, [1, 2, 3]), timeout=1.0, limits=LIMITS))

    replies = []
    for nid, update in updates.items():
        instruction = Message(RecordDict(), dst_node_id=nid, message_type=MessageType.TRAIN)
        instruction.metadata.__dict__["_message_id"] = instruction.object_id
        content = RecordDict(
            {
                "arrays": ArrayRecord([update[k] for k in sorted(update)]),
                "metrics": MetricRecord({"num-examples": examples[nid]}),
            }
        )
        replies.append(Message(content, reply_to=instruction))
    flower, _ = FlowerFedAvg().aggregate_train(1, replies)
    theirs = flower.to_numpy_ndarrays()
    for key, value in zip(sorted(START), theirs):
        np.testing.assert_allclose(ours.eval_arrays(1)[key], value, rtol=1e-6, atol=1e-7)


def _with_count(reply: RecordDict, count) -> RecordDict:
    """A train reply whose num_examples is ``count`` as sent, whatever its type (a lying or broken client)."""
    from flwr.app import MetricRecord

    reply["fitres.num_examples"] = MetricRecord({"num_examples": count})
    return reply


def test_a_hostile_reply_costs_only_its_own_contribution(caplog):
    """Each of these aborted the ServerApp or poisoned the mean before: the round goes on with the good members,
    and every bad one is named with its reason."""
    from flwr.app import ConfigRecord

    def metrics_with(**bad):
        return lambda a: train_reply({k: v + 1.0 for k, v in a.items()}, 5, {**METRICS, **bad})

    def raw_metrics(value):  # a bytes value cannot even be put in a ConfigRecord by train_reply's path
        def reply(a):
            content = train_reply({k: v + 1.0 for k, v in a.items()}, 5, METRICS)
            content["fitres.metrics"] = ConfigRecord({**METRICS, "train_loss": value})
            return content

        return reply

    behaviour = {
        1: good(1.0, 10),
        2: good(3.0, 30),
        3: lambda a: _with_count(train_reply({k: v + 9 for k, v in a.items()}, 5, METRICS), float("inf")),
        4: lambda a: _with_count(train_reply({k: v + 9 for k, v in a.items()}, 5, METRICS), [5, 5]),
        5: metrics_with(train_loss="low"),
        6: lambda a: train_reply(
            {k: v + 1.0 for k, v in a.items()}, 5, {k: v for k, v in METRICS.items() if k != "train_loss"}
        ),
        7: raw_metrics(b"\x00\x01"),
        8: lambda a: train_reply({k: np.full(v.shape, 1e39) for k, v in a.items()}, 5, METRICS),  # float64 beyond f32
        9: lambda a: train_reply({k: v + 1e4 for k, v in a.items()}, 5, METRICS),  # far beyond max-update-norm
        10: metrics_with(secagg_clipped="x"),  # accepted before, then the row builder's int() stopped the run
    }
    grid = InMemoryGrid(behaviour)
    (result,) = train_groups_plain(grid, 1, [Group("all", {n: START for n in behaviour})], 1.0, limits=LIMITS)
    assert sorted(result.contributors) == [1, 2]
    expected = weighted_mean([{k: v + 1.0 for k, v in START.items()}, {k: v + 3.0 for k, v in START.items()}], [10, 30])
    for key in START:
        np.testing.assert_allclose(result.mean[key], expected[key], rtol=1e-6)
    why = result.rejected
    assert "num_examples" in why[3] and "finite" in why[3]
    assert "num_examples" in why[4] and "number" in why[4]
    assert "train_loss" in why[5] and "train_loss" in why[6] and "missing" in why[6]
    assert "train_loss" in why[7] and "bytes" in why[7]
    assert "NaN or Inf" in why[8]
    assert "max-update-norm" in why[9]
    assert "secagg_clipped" in why[10] and "must be a number" in why[10]


def test_a_weight_beyond_the_instruction_is_capped_and_clipping_is_reported():
    """One client claiming 1e12 examples no longer owns the average; with robust.clip-norm a far update is scaled
    back to the norm, and both adjustments are reported with the member."""
    behaviour = {
        1: good(1.0, 10),
        2: lambda a: _with_count(train_reply({k: v + 3.0 for k, v in a.items()}, 5, METRICS), 1e12),
    }
    (result,) = train_groups_plain(InMemoryGrid(behaviour), 1, [Group("all", {1: START, 2: START})], 1.0, LIMITS)
    assert result.metrics[2]["num_examples"] == LIMITS.examples_per_round
    assert "capped at 100" in result.metrics[2]["robust"][0]
    expected = weighted_mean(
        [{k: v + 1.0 for k, v in START.items()}, {k: v + 3.0 for k, v in START.items()}], [10, 100]
    )
    for key in START:
        np.testing.assert_allclose(result.mean[key], expected[key], rtol=1e-6)

    clip = ReplyLimits(examples_per_round=100, clip_norm=1.0)
    (result,) = train_groups_plain(InMemoryGrid({1: good(1.0, 10)}), 1, [Group("all", {1: START})], 1.0, clip)
    from common.reply_checks import update_norm

    assert update_norm(result.mean, START) == pytest.approx(1.0, rel=1e-5)
    assert "clipped" in result.metrics[1]["robust"][0]


def test_a_second_node_claiming_a_partition_is_left_out_not_the_run():
    from common.records import initial_reply
    from server_app.admission import Admission
    from server_app.app import _admit_new_nodes
    from strategies.fedavg import FedAvg

    kept, left_out = Admission().admit({n: ClientInfo(n, p, "m", START) for n, p in ((2, 0), (5, 1), (9, 1))})
    assert sorted(kept) == [2, 5] and list(left_out) == [9] and "already node 5's" in left_out[9]
    assert Admission().admit({n: ClientInfo(n, n, "m", START) for n in (1, 2, 3)})[1] == {}

    # mid-run: a node claiming the partition of a node still connected is left out; a restarted node (its old id
    # gone) takes its partition back
    grid = InMemoryGrid(
        {nid: lambda content: initial_reply(START, {"partition-id": 0, "model": "m"}) for nid in (7, 8)}
    )
    strategy, refused = FedAvg(), set()
    clients = {1: ClientInfo(1, 0, "m", START)}
    strategy.initialise(dict(clients))
    cfg = load_run_config({"round-timeout": 1.0})
    assert _admit_new_nodes(grid, cfg, strategy, clients, refused, [1, 7]) == [1] and refused == {7}
    assert _admit_new_nodes(grid, cfg, strategy, clients, refused, [8]) == [8] and clients[8].partition_id == 0


def test_an_evaluation_reply_claiming_more_examples_or_another_partition_loses_only_its_row():
    """eval_examples weighs a reply in the round's mean and the row's partition id names the client: a reply may not
    claim more examples than the server asked for, nor another partition than the node was admitted with."""
    from common.records import metrics_reply
    from server_app.transport import evaluate_nodes

    good_eval = {"eval_loss": 2.0, "exact_match": 0.5, "rouge_l": 0.5, "eval_examples": 8}
    behaviour = {
        1: lambda content: metrics_reply({**good_eval, "partition-id": 0}),
        2: lambda content: metrics_reply({**good_eval, "partition-id": 1, "eval_examples": 10**9}),
        3: lambda content: metrics_reply({**good_eval, "partition-id": 0}),  # node 3 was admitted as partition 2
    }
    grid = InMemoryGrid(behaviour)
    out = evaluate_nodes(grid, 1, {n: START for n in behaviour}, 1.0, None, 8, {1: 0, 2: 1, 3: 2})
    assert out[1]["eval_loss"] == 2.0
    assert "more than the 8 examples asked for" in out[2]
    assert "admitted as partition 2" in out[3]


def test_every_accepted_update_has_its_norm_measured_by_the_server_and_the_round_its_median():
    """robust.max-update-norm is the hostile member's budget; to choose it an operator needs what honest updates
    look like: each train row has the update's L2 distance from what was sent (measured by the server in plain
    mode, whatever the member claims) and the round's row their median."""
    from server_app.training import train_rows

    behaviour = {
        1: good(1.0, 10),
        2: lambda a: train_reply({k: v + 3.0 for k, v in a.items()}, 10, {**METRICS, "update_norm": 0.0}),  # lies
    }
    grid = InMemoryGrid(behaviour)
    (result,) = train_groups_plain(grid, 1, [Group("all", {n: START for n in behaviour})], 1.0, limits=LIMITS)
    size = sum(v.size for v in START.values())
    assert result.metrics[1]["update_norm"] == pytest.approx(np.sqrt(size))
    assert result.metrics[2]["update_norm"] == pytest.approx(3 * np.sqrt(size))  # measured, not the member's word
    rows = train_rows([result], 0.0, {})
    assert rows[1]["update_norm"] == pytest.approx(np.sqrt(size))
    assert rows[None]["update_norm_median"] == pytest.approx(2 * np.sqrt(size))


def test_in_the_clear_a_reply_the_strategys_sum_check_refuses_is_left_out_alone():
    """The strategy's ``check_sum`` runs on each reply as a group of one: the member whose update no honest member
    can send is left out with the strategy's reason, and the group's mean is the others'."""

    def no_big_values(result):
        return "a value above 2" if max(np.abs(v).max() for v in result.mean.values()) > 2 else None

    behaviour = {1: good(1.0, 10), 2: good(1.5, 10), 3: good(8.0, 10)}
    group = Group("all", {n: START for n in behaviour})
    (result,) = train_groups_plain(InMemoryGrid(behaviour), 1, [group], 1.0, LIMITS, check_sum=no_big_values)
    assert sorted(result.contributors) == [1, 2] and "a value above 2" in result.rejected[3]
    for key in START:
        np.testing.assert_allclose(result.mean[key], START[key] + 1.25)


def test_a_clients_error_reason_reaches_the_servers_log_on_one_line(capsys):
    """Log forging: a member's error text with line breaks and terminal escapes is one inert line in the server's
    log and its row."""
    import logging

    from common.logs import OneLineFormatter
    from server_app.transport import _short_reason

    forged = "bad\n12:00:00 tessera.server INFO round 9: all good\r\x1b[2Kdone\u2028x"
    reason = _short_reason(forged)
    assert "\n" not in reason and "\r" not in reason and "\x1b" not in reason and "\u2028" not in reason
    assert reason.startswith("bad\\n12:00:00") and "\\x1b[2K" in reason
    record = logging.LogRecord("tessera.server", logging.WARNING, "f", 1, "node %d: %s", (3, forged), None)
    line = OneLineFormatter("%(levelname)s %(message)s").format(record)
    assert line.count("\n") == 0 and line.startswith("WARNING node 3: bad\\n")


def test_a_train_instruction_key_set_by_two_sources_is_refused_naming_both():
    from common.messages import SecAggPart, read_train
    from server_app.transport import member_config
    from strategies.atlas.wire import AtlasWire

    group = Group(
        "g", {1: {}, 2: {}}, config=AtlasWire(neighbour_term=True), member_configs={2: AtlasWire(own_ranks=(4,))}
    )
    bounds = SecAggPart(clipping_range=8.0, max_weight=16.0, clip_norm=1.0)
    config = member_config(group, 3, 2, bounds)
    assert config == {
        "server-round": 3,
        "neighbour-term": True,
        "lora-ranks": "4",
        "weight-by": "examples",
        "secagg-clipping-range": 8.0,
        "secagg-max-weight": 16.0,
        "secagg-clip-norm": 1.0,
    }
    read = read_train(config, AtlasWire)  # what the member reads back: the same parts
    assert read.round.server_round == 3 and read.secagg == bounds and read.dp is None
    assert read.strategy == AtlasWire(neighbour_term=True, own_ranks=(4,))
    own = Group("g", {1: {}}, config=AtlasWire(own_ranks=(1,)), member_configs={1: AtlasWire(own_ranks=(2,))})
    with pytest.raises(ValueError, match="'lora-ranks' set by group g and by node 1's own"):
        member_config(own, 1, 1)
