"""Flower's real SecAgg+ (Flower's simulation, in a child process) carries a group mean equal to the plain one
within the quantisation bound. The clients here return synthetic adapters (no LLM) so the test takes seconds."""

import json
from pathlib import Path

import numpy as np
import pytest
from child import SIMULATION_BACKEND, run_in_child
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from client_app.app import secure_aggregation_mod
from common.config import SecAggSection
from common.messages import read_train
from common.records import read_train_instruction, train_reply
from common.reply_checks import IDENTITY_METRICS, ReplyLimits
from server_app.secure import train_group_secure
from server_app.transport import wait_for_nodes
from strategies.aggregation import secagg_error_bound, secagg_weights, weighted_mean
from strategies.base import Group
from strategies.simgrad.wire import SimGradWire

NAMES = ["x.lora_A.weight", "x.lora_B.weight"]
START = {"x.lora_A.weight": np.full((3, 4), 0.1, np.float32), "x.lora_B.weight": np.zeros((4, 3), np.float32)}
MAX_WEIGHT = 40.0


# PQ-LoRA's arrays (SimGrad): members receive every block's global P/Q but send back only the routed block.
PQ_START = {
    f"block{b}.q_proj.{k}": np.full((2, 2) if k == "P" else (2,), 0.1 * b, np.float32)
    for b in range(2)
    for k in ("P", "Q")
}
PQ_SEND_BACK = ["block1.q_proj.P", "block1.q_proj.Q"]


def client_update(partition_id: int, start=START, send_back=None) -> tuple[dict, int]:
    rng = np.random.default_rng(partition_id)
    names = send_back or sorted(start)
    return {k: start[k] + rng.normal(scale=0.5, size=start[k].shape).astype(np.float32) for k in names}, 10 * (
        partition_id + 1
    )


def run_secure_round(tmp_path, num_nodes: int, routed: bool = False, liar: str = "") -> dict:
    """One SecAgg+ round among ``num_nodes`` clients, in a child process (``tests/child.py``); what it returned.
    ``liar``: partition 0 reports a weight in the clear other than the one it masked ("low": 1, "high": 10^9)."""
    run_in_child("test_secagg", "secure_round_in_process", str(tmp_path), num_nodes, routed, liar)
    return json.loads((tmp_path / "result.json").read_text())


def lying_mod(reported: int):
    """Around ``secaggplus_mod``: after masking with its true weight, partition 0 reports ``reported`` instead."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        counts = reply.content.metric_records.get("fitres.num_examples")
        if counts is not None and int(context.node_config["partition-id"]) == 0:
            counts["num_examples"] = reported
        return reply

    return mod


def secure_round_in_process(tmp_path: str, num_nodes: int, routed: bool, liar: str) -> None:
    start, send_back = (PQ_START, PQ_SEND_BACK) if routed else (START, None)
    out_file = Path(tmp_path) / "result.json"
    mods = [lying_mod({"low": 1, "high": 10**9}[liar])] if liar else []
    client = ClientApp(mods=[*mods, secure_aggregation_mod])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        arrays, config = read_train_instruction(msg.content, start)
        instruction = read_train(config, SimGradWire)
        assert all(np.allclose(arrays[k], start[k]) for k in start) and instruction.round.server_round == 1
        assert instruction.secagg is not None and instruction.secagg.max_weight == MAX_WEIGHT  # SecAgg+'s part
        routed = instruction.strategy.active_blocks if instruction.strategy else None
        assert routed == ((1,) if send_back else None)  # the group's config arrives
        update, n = client_update(int(context.node_config["partition-id"]), start, send_back)
        metrics = {"partition-id": int(context.node_config["partition-id"]), "beta": [0.5, 0.4]}
        return Message(train_reply(update, n, metrics), reply_to=msg)

    server = ServerApp()
    # what Flower's real members masked as their total weight, taken where the workflow unmasks it
    from flwr.server.workflow.secure_aggregation import secaggplus_workflow

    unmasked_weights: list[int] = []
    inner = secaggplus_workflow.factor_extract

    def spying_factor_extract(parameters):
        factor, rest = inner(parameters)
        unmasked_weights.append(int(factor))
        return factor, rest

    secaggplus_workflow.factor_extract = spying_factor_extract

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        nodes = wait_for_nodes(grid, num_nodes, timeout=120)
        group = Group(
            "all", {n: start for n in nodes}, send_back, SimGradWire(active_blocks=(1,)) if send_back else None
        )
        limits = ReplyLimits(examples_per_round=int(MAX_WEIGHT), train_metrics=IDENTITY_METRICS)
        result = train_group_secure(grid, context, 1, group, SecAggSection(), limits)
        out_file.write_text(
            json.dumps(
                {
                    "mean": None if result.mean is None else {k: v.tolist() for k, v in result.mean.items()},
                    "aggregate_rejected": result.aggregate_rejected,
                    "partitions": sorted(m["partition-id"] for m in result.metrics.values() if m),
                    "examples": {str(m["partition-id"]): m["num_examples"] for m in result.metrics.values() if m},
                    "rejected": result.rejected,
                    "unmasked_weights": unmasked_weights,
                }
            )
        )

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=num_nodes,
        backend_config=SIMULATION_BACKEND,
    )


@pytest.fixture(scope="module")
def honest_round(tmp_path_factory) -> dict:
    return run_secure_round(tmp_path_factory.mktemp("honest"), num_nodes=4)


def test_secure_mean_equals_plain_weighted_mean(honest_round):
    out = honest_round
    assert out["partitions"] == [0, 1, 2, 3] and out["rejected"] == {}
    updates, examples = zip(*(client_update(p) for p in range(4)))
    weights = secagg_weights(examples, MAX_WEIGHT)  # 10, 20, 30, 40 examples -> 0.25 .. 1.0
    plain = weighted_mean(list(updates), weights)
    bound = secagg_error_bound(weights, SecAggSection().clipping_range, SecAggSection().quantization_range)
    for key in NAMES:
        secure = np.asarray(out["mean"][key], dtype=np.float32)
        err = np.abs(secure - plain[key]).max()
        assert err <= bound, (key, err, bound)
        # and it is not simply the unweighted mean: weights matter
        assert np.abs(plain[key] - np.mean([u[key] for u in updates], axis=0)).max() > 10 * bound


def test_secure_routed_pq_group_mean_equals_the_plain_group_mean():
    """SimGrad's secure mode: a group of 3 sends only its routed block through SecAgg+; the unmasked mean equals
    the plain-mode group mean within the quantisation bound, and the strategy mixes it like plain means."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = run_secure_round(Path(tmp), num_nodes=3, routed=True)
    assert out["partitions"] == [0, 1, 2] and sorted(out["mean"]) == PQ_SEND_BACK
    updates, examples = zip(*(client_update(p, PQ_START, PQ_SEND_BACK) for p in range(3)))
    weights = secagg_weights(examples, MAX_WEIGHT)
    plain = weighted_mean(list(updates), weights)
    bound = secagg_error_bound(weights, SecAggSection().clipping_range, SecAggSection().quantization_range)
    for key in PQ_SEND_BACK:
        assert np.abs(np.asarray(out["mean"][key], dtype=np.float32) - plain[key]).max() <= bound


@pytest.mark.parametrize("liar", ["low", "high"])
def test_a_member_reporting_another_weight_than_it_masked_costs_the_group_its_aggregate(tmp_path, liar):
    """Partition 0 masks its update with weight 10 and reports 1 (to look small) or 10^9 (over the cap) in the
    clear: the weight SecAgg+ unmasks disagrees, or the cap is broken, so the aggregate is refused, not used."""
    out = run_secure_round(tmp_path, num_nodes=3, liar=liar)
    assert out["mean"] is None and out["aggregate_rejected"], out
    if liar == "low":
        assert "reported num_examples" in out["aggregate_rejected"]
    else:
        assert "over the group's cap" in json.dumps(out["rejected"])


def test_the_weight_check_accepts_what_flowers_real_members_masked(honest_round):
    """The total weight Flower's own members masked in a real SecAgg+ round (taken where the workflow unmasks it,
    not recomputed with the check's formula) passes the check for their reported weights; one unit off does not."""
    from common.core_sections import MODULUS_RANGE
    from common.reply_checks import masked_weight_problem

    (masked,) = honest_round["unmasked_weights"]
    reported = {int(p): n for p, n in honest_round["examples"].items()}
    assert reported == {0: 10, 1: 20, 2: 30, 3: 40}
    q = SecAggSection().quantization_range
    assert masked_weight_problem(masked, reported, MAX_WEIGHT, q, MODULUS_RANGE) is None
    assert masked_weight_problem(masked + 1, reported, MAX_WEIGHT, q, MODULUS_RANGE)
    assert masked_weight_problem(masked, {**reported, 3: 39}, MAX_WEIGHT, q, MODULUS_RANGE)


def test_the_weight_check_catches_a_wrapped_weight():
    from common.core_sections import MODULUS_RANGE
    from common.reply_checks import masked_weight_problem

    q = SecAggSection().quantization_range
    honest = {1: 10, 2: 25, 3: 40}
    lying = sum(round(n / MAX_WEIGHT * q) for n in (10, 25, 4000)) % MODULUS_RANGE  # 4000 masked, 40 reported
    assert "reported num_examples to 75" in (masked_weight_problem(lying, honest, MAX_WEIGHT, q, MODULUS_RANGE) or "")


def test_members_count_the_values_secagg_will_clip():
    """SecAgg+ clamps weighted values to +-clipping-range silently; each member counts them so the round says so."""
    from client_app.handlers import secagg_clipped
    from common.messages import SecAggPart

    update = {"a": np.array([1.0, 9.0, -20.0], np.float32), "b": np.array([[7.9, -8.1]], np.float32)}
    config = SecAggPart(clipping_range=8.0, max_weight=10.0, clip_norm=1.0)
    assert secagg_clipped(update, 10, config) == 3  # 9, -20, -8.1
    assert secagg_clipped(update, 5, config) == 1  # halved: only -20 -> -10
    assert secagg_clipped(update, 50, config) == 3  # the ratio is capped at 1, as members cap their weight


# One simulation of 4 members, one SecAgg+ group per round; partition 0 attacks as the round's scenario says.
# (round, attack, members) -- round 1 is honest and tells the server which node is which partition.
HOSTILE_ROUNDS = [
    (1, None, 4),
    (2, "shift", 3),
    (3, "nudge", 3),
    (4, "long", 4),
    (5, "scalar", 4),
    (6, "short", 4),
    (7, "dropout", 4),
    (8, "dropout", 3),
    (9, "long", 3),
]
HOSTILE_NORM = 5.0  # robust.max-update-norm for these rounds: honest updates here have norm ~2.5


def hostile_rounds_in_process(tmp_path: str) -> None:
    from hostile import hostile_mod

    attacks = {str(r): a for r, a, _ in HOSTILE_ROUNDS}
    client = ClientApp(mods=[hostile_mod(lambda p, g: attacks.get(g) if p == 0 else None), secure_aggregation_mod])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        update, n = client_update(int(context.node_config["partition-id"]))
        metrics = {"partition-id": int(context.node_config["partition-id"])}
        return Message(train_reply(update, n, metrics), reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        nodes = wait_for_nodes(grid, 4, timeout=120)
        limits = ReplyLimits(int(MAX_WEIGHT), max_update_norm=HOSTILE_NORM, train_metrics=IDENTITY_METRICS)
        partition_of: dict[int, int] = {}
        out = {}
        for server_round, _, size in HOSTILE_ROUNDS:
            members = nodes if not partition_of else sorted(nodes, key=partition_of.__getitem__)[:size]
            group = Group("g", {n: START for n in members})
            result = train_group_secure(grid, context, server_round, group, SecAggSection(), limits)
            if server_round == 1:
                partition_of = {n: m["partition-id"] for n, m in result.metrics.items()}
            out[server_round] = {
                "mean": None if result.mean is None else {k: v.tolist() for k, v in result.mean.items()},
                "aggregate_rejected": result.aggregate_rejected,
                "contributors": sorted(partition_of.get(n, -1) for n in result.contributors),
                "rejected": {str(partition_of.get(n, -1)): why for n, why in result.rejected.items()},
            }
        (Path(tmp_path) / "result.json").write_text(json.dumps(out))

    run_simulation(server_app=server, client_app=client, num_supernodes=4, backend_config=SIMULATION_BACKEND)


@pytest.fixture(scope="module")
def hostile_rounds(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("hostile")
    run_in_child("test_secagg", "hostile_rounds_in_process", str(tmp))
    return {int(k): v for k, v in json.loads((tmp / "result.json").read_text()).items()}


def _plain_mean_of(partitions: list[int]) -> tuple[dict, float]:
    updates, examples = zip(*(client_update(p) for p in partitions))
    weights = secagg_weights(examples, MAX_WEIGHT)
    bound = secagg_error_bound(weights, SecAggSection().clipping_range, SecAggSection().quantization_range)
    return weighted_mean(list(updates), weights), bound


def test_an_honest_group_passes_the_bounds_hostile_ones_are_checked_against(hostile_rounds):
    honest = hostile_rounds[1]
    assert honest["aggregate_rejected"] is None and honest["contributors"] == [0, 1, 2, 3], honest
    plain, bound = _plain_mean_of([0, 1, 2, 3])
    assert all(np.abs(np.asarray(honest["mean"][k]) - plain[k]).max() <= bound for k in NAMES)


@pytest.mark.parametrize("server_round, says", [(2, "outside what 3 members"), (3, "(L2) from its members' starts")])
def test_a_member_masking_out_of_range_values_costs_its_group_the_aggregate(hostile_rounds, server_round, says):
    """Partition 0 masks its honest weight but adds 4 x the quantisation range to every value (the group mean would
    move by ~20 per coordinate), or a quarter of it (inside the box, ~10 in L2): the aggregate is refused, named."""
    out = hostile_rounds[server_round]
    assert out["mean"] is None and says in (out["aggregate_rejected"] or ""), out


@pytest.mark.parametrize("server_round", [4, 5, 6, 7])
def test_a_malformed_or_missing_masked_vector_costs_only_its_member(hostile_rounds, server_round):
    """A masked update of the wrong length, of shape (1,) (Flower would broadcast it), missing, or never sent:
    the member is left out as a dropped one, its masks are removed, and the other three members' mean is exact."""
    out = hostile_rounds[server_round]
    assert out["aggregate_rejected"] is None and out["contributors"] == [1, 2, 3], out
    says = "dropped out" if server_round == 7 else "masked"
    assert list(out["rejected"]) == ["0"] and says in out["rejected"]["0"], out
    plain, bound = _plain_mean_of([1, 2, 3])
    assert all(np.abs(np.asarray(out["mean"][k]) - plain[k]).max() <= bound for k in NAMES)


@pytest.mark.parametrize("server_round", [8, 9])
def test_a_three_member_group_never_finishes_with_two(hostile_rounds, server_round):
    """One of three drops out after the share-keys stage (or is refused for a malformed vector): Flower's own
    threshold (2 of 3) would finish with two, each then knowing the other's update; the group halts, named."""
    out = hostile_rounds[server_round]
    assert out["mean"] is None and out["contributors"] == [] and "halted" in (out["aggregate_rejected"] or ""), out
    assert "0" in out["rejected"]
    if server_round == 9:
        assert "masked" in out["rejected"]["0"]


def test_the_reconstruction_threshold_never_lets_fewer_than_three_finish():
    from common.secure_bounds import flower_shares_and_threshold, reconstruction_threshold

    assert flower_shares_and_threshold(3, 1.0, 0.67) == (3, 2)  # Flower's own: two of three would finish
    for size in range(3, 40):
        for shares in (1.0, 0.5, 0.3):
            for threshold in (0.1, 0.5, 0.67, 1.0):
                needed = reconstruction_threshold(size, shares, threshold)
                assert 3 <= needed <= flower_shares_and_threshold(size, shares, threshold)[0]


def test_a_reply_carrying_a_good_masked_vector_and_foreign_shares_is_screened_on_both(task_identity):
    """The screen looked at the masked vector and let the reply through without looking at the share list beside
    it; each part a reply carries is screened now."""
    import io

    from flwr.app import ConfigRecord, Message
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    from common.records import train_reply
    from server_app.secure import _ScreenedGrid

    def blob(array):
        out = io.BytesIO()
        np.save(out, array)
        return out.getvalue()

    content = train_reply({"w": np.zeros(3, np.float32)}, 2, {"train_loss": 1.0})
    masked = [blob(np.array([1], np.int64)), blob(np.arange(4, dtype=np.int64))]
    configs = {Key.MASKED_PARAMETERS: masked}
    screen = _ScreenedGrid(None, 4, [1, 2, 3], "test")
    content[RECORD_KEY_CONFIGS] = ConfigRecord(configs)
    assert screen._problem(Message(content, dst_node_id=1, message_type="train")) is None  # the vector alone passes
    content[RECORD_KEY_CONFIGS] = ConfigRecord({**configs, Key.NODE_ID_LIST: [999], Key.SHARE_LIST: [b"x"]})
    problem = screen._problem(Message(content, dst_node_id=1, message_type="train"))
    assert problem is not None and "outside the group" in problem
