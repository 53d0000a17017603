"""Flower's real SecAgg+ (Flower's simulation, in a child process) carries a group mean equal to the plain one
within the quantisation bound. The clients here return synthetic adapters (no LLM) so the test takes seconds."""

import json
from pathlib import Path

import numpy as np
from child import run_in_child
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from client_app.app import secure_aggregation_mod
from common.config import SecAggSection
from common.records import read_train_instruction, train_reply
from server_app.transport import train_group_secure, wait_for_nodes
from strategies.aggregation import secagg_error_bound, secagg_weights, weighted_mean
from strategies.base import Group

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


def run_secure_round(tmp_path, num_nodes: int, routed: bool = False) -> dict:
    """One SecAgg+ round among ``num_nodes`` clients, in a child process (``tests/child.py``); what it returned."""
    run_in_child("test_secagg", "secure_round_in_process", str(tmp_path), num_nodes, routed)
    return json.loads((tmp_path / "result.json").read_text())


def secure_round_in_process(tmp_path: str, num_nodes: int, routed: bool) -> None:
    start, send_back = (PQ_START, PQ_SEND_BACK) if routed else (START, None)
    out_file = Path(tmp_path) / "result.json"
    client = ClientApp(mods=[secure_aggregation_mod])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        arrays, config = read_train_instruction(msg.content, start)
        assert all(np.allclose(arrays[k], start[k]) for k in start) and config["server-round"] == 1
        assert config.get("active-blocks", "all") == ("1" if send_back else "all")  # the group's config arrives
        update, n = client_update(int(context.node_config["partition-id"]), start, send_back)
        metrics = {"partition-id": int(context.node_config["partition-id"]), "beta": [0.5, 0.4]}
        return Message(train_reply(update, n, metrics), reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        nodes = wait_for_nodes(grid, num_nodes, timeout=120)
        group = Group("all", {n: start for n in nodes}, send_back, {"active-blocks": "1"} if send_back else {})
        result = train_group_secure(grid, context, 1, group, {"server-round": 1}, SecAggSection(), MAX_WEIGHT)
        out_file.write_text(
            json.dumps(
                {
                    "mean": {k: v.tolist() for k, v in result.mean.items()},
                    "partitions": sorted(m["partition-id"] for m in result.metrics.values()),
                    "examples": {str(m["partition-id"]): m["num_examples"] for m in result.metrics.values()},
                    "rejected": result.rejected,
                }
            )
        )

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=num_nodes,
        backend_config={"client_resources": {"num_cpus": 1}},
    )


def test_secure_mean_equals_plain_weighted_mean(tmp_path):
    out = run_secure_round(tmp_path, num_nodes=4)
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


def test_members_count_the_values_secagg_will_clip():
    """SecAgg+ clamps weighted values to +-clipping-range silently; each member counts them so the round says so."""
    from client_app.handlers import secagg_clipped
    from strategies.base import SECAGG_CLIP, SECAGG_MAX_WEIGHT

    update = {"a": np.array([1.0, 9.0, -20.0], np.float32), "b": np.array([[7.9, -8.1]], np.float32)}
    config = {SECAGG_CLIP: 8.0, SECAGG_MAX_WEIGHT: 10.0}
    assert secagg_clipped(update, 10, config) == 3  # 9, -20, -8.1
    assert secagg_clipped(update, 5, config) == 1  # halved: only -20 -> -10
    assert secagg_clipped(update, 50, config) == 3  # the ratio is capped at 1, as Flower does
