"""A strategy added the documented way (docs/adding-a-strategy.md; ``toy_strategy.py``: one file, one ``register``
call) runs end to end through the real ServerApp, ClientApp, plain transport and Flower's SecAgg+ (in-process
simulation, tiny model): its config section is validated, its own member weighting is honoured by both transports,
its client state survives between messages, its reply metrics reach metrics.jsonl."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from child import SIMULATION_BACKEND, run_in_child
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from common.config import ConfigError, SecAggSection
from strategies import REGISTRY, load_run_config
from strategies.aggregation import secagg_error_bound, secagg_weights, weighted_mean


@pytest.fixture
def toymean():
    import toy_strategy

    REGISTRY[toy_strategy.SPEC.name] = toy_strategy.SPEC
    yield toy_strategy
    REGISTRY.pop(toy_strategy.SPEC.name, None)  # other tests see only the built-in strategies


def run(run_config: dict, nodes: int = 3, hostile: dict[str, str] | None = None) -> None:
    run_in_child("test_toy_strategy", "run_in_process", run_config, nodes, hostile)


Plan = dict[str, dict[str, str]]  # partition id -> server round -> reply attack (tests/hostile.py's REPLY_ATTACKS)


def run_in_process(run_config: dict, nodes: int, hostile: dict[str, str] | None = None, tamper: Plan | None = None):
    import toy_strategy  # noqa: F401  (registers the toy in this process, where the ServerApp runs)

    client = _client_app(run_config, hostile, tamper, nodes)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from server_app.app import run_federation

        context.run_config = dict(run_config)
        run_federation(grid, context)

    run_simulation(server_app=server, client_app=client, num_supernodes=nodes, backend_config=SIMULATION_BACKEND)


def _client_app(
    run_config: dict, hostile: dict[str, str] | None = None, tamper: Plan | None = None, nodes: int = 3
) -> ClientApp:
    """The real ClientApp's handlers with our run config; ``hostile``: partition id -> SecAgg+ attack in round 1,
    ``tamper``: partition id -> round -> what its train reply is rewritten to (``tests/hostile.py``)."""
    from client_app.app import secure_aggregation_mod

    mods = [secure_aggregation_mod]
    if hostile:
        from hostile import hostile_mod

        mods.insert(0, hostile_mod(lambda p, group_id: hostile.get(str(p)) if group_id == "1" else None))
    app = ClientApp(mods=mods)

    def handle(kind: str, msg: Message, context: Context) -> Message:
        import toy_strategy  # noqa: F401  (registers the toy in this worker process)

        from client_app.handlers import handle as real_handle

        # run_simulation has no run config: the same client (node config, state) with ours
        ours = Context(context.run_id, context.node_id, dict(context.node_config), context.state, dict(run_config))
        attack = (tamper or {}).get(str(context.node_config["partition-id"]), {}).get(msg.metadata.group_id)
        if kind == "train" and attack:
            return _tampered(attack, nodes, lambda: real_handle(kind, msg, ours))
        return real_handle(kind, msg, ours)

    app.query()(lambda msg, context: handle("query", msg, context))
    app.train()(lambda msg, context: handle("train", msg, context))
    app.evaluate()(lambda msg, context: handle("evaluate", msg, context))
    return app


def _tampered(attack: str, members: int, handle: Callable[[], Message]) -> Message:
    """The handler's train reply, its arrays and metrics rewritten by ``attack`` before they are packed (and, in
    secure mode, masked): what a member whose own code is hostile sends."""
    from hostile import tamper_reply

    import client_app.handlers as handlers

    honest = handlers.train_reply

    def hostile_reply(arrays, num_examples, metrics):
        arrays, metrics = tamper_reply(arrays, metrics, attack, members)
        return honest(arrays, num_examples, metrics)

    handlers.train_reply = hostile_reply
    try:
        return handle()
    finally:
        handlers.train_reply = honest


def config(tiny_llama_dir, run_dir: Path, **extra) -> dict:
    return {
        "strategy": "toymean",
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "num-server-rounds": 2,
        "min-train-replies": 3,
        "train.local-steps": 2,
        "train.batch-size": 1,
        "train.learning-rate": 0.1,  # updates that differ between clients, so that weights matter
        "eval.max-examples": 1,
        "eval.max-new-tokens": 2,
        "run-dir": str(run_dir),
        "node-wait-timeout": 120.0,
        **extra,
    }


def final_and_expected(run_dir: Path) -> tuple[dict, dict, list[float]]:
    """The server's final adapter, and the partition-weighted mean of the updates the clients wrote in round 2."""
    from server_app.rundir import RunDirectory

    _, state = RunDirectory(run_dir).load_checkpoint()
    updates = {p: dict(np.load(run_dir / "toy-updates" / f"partition-{p}-round-2.npz")) for p in range(3)}
    weights = [p + 1.0 for p in range(3)]
    return state["global"], weighted_mean([updates[p] for p in range(3)], weights), weights


def test_the_toy_config_section_is_validated(toymean):
    assert load_run_config({"strategy": "toymean", "toymean.step": 0.5}).section(toymean.ToyMeanSection).step == 0.5
    with pytest.raises(ConfigError, match="toymean.step"):
        load_run_config({"strategy": "toymean", "toymean.step": 2})


@pytest.mark.e2e
@pytest.mark.parametrize("secure", [False, True])
def test_a_registered_toy_strategy_runs_end_to_end(toymean, tiny_llama_dir, tmp_path, secure):
    run_dir = tmp_path / "run"
    run(config(tiny_llama_dir, run_dir, secure=secure))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for server_round in (1, 2):  # the client half's state (rounds it trained) was kept between messages
        trained = [r for r in rows if r["round"] == server_round and r["node"] is not None]
        assert len(trained) == 3 and all(r["accepted"] and r["rounds_trained"] == server_round for r in trained)
    summary = {r["round"]: r for r in rows if r["node"] is None}
    assert summary[1]["max_update_norm"] == 1e3  # round 1: the operator's bound; round 2: chosen from round 1's norms
    assert summary[2]["max_update_norm"] == pytest.approx(10 * summary[1]["update_norm_median"])
    final, expected, weights = final_and_expected(run_dir)
    if secure:  # SecAgg+ multiplied each update by (p + 1) / max_weight before masking: the same weighting
        scaled = secagg_weights([int(w) for w in weights], max_weight=3.0)
        bound = secagg_error_bound(scaled, SecAggSection().clipping_range, SecAggSection().quantization_range)
    else:
        bound = 1e-6
    for key, value in expected.items():
        assert np.abs(final[key] - value).max() <= bound, key
    unweighted = weighted_mean(
        [dict(np.load(run_dir / "toy-updates" / f"partition-{p}-round-2.npz")) for p in range(3)], [1.0, 1.0, 1.0]
    )
    assert max(np.abs(final[k] - unweighted[k]).max() for k in final) > 10 * bound  # the weighting mattered
    assert (run_dir / "adapter" / "adapter_config.json").exists()  # saved the way its adapter kind (LoRA) saves


@pytest.mark.e2e
def test_secure_groups_of_a_round_run_concurrently_and_each_sums_its_own_members(toymean, tiny_llama_dir, tmp_path):
    """Two SecAgg+ groups in one round (6 clients, partition id mod 2), run at the same time: each group's mean is
    its own members' weighted mean, and the global adapter is the average of the two."""
    run_dir = tmp_path / "run"
    run(config(tiny_llama_dir, run_dir, secure=True, **{"num-server-rounds": 1, "toymean.groups": 2}), nodes=6)
    from server_app.rundir import RunDirectory

    _, state = RunDirectory(run_dir).load_checkpoint()
    updates = {p: dict(np.load(run_dir / "toy-updates" / f"partition-{p}-round-1.npz")) for p in range(6)}
    group_means, bound = [], 0.0
    for g in (0, 1):
        members = [p for p in range(6) if p % 2 == g]
        group_means.append(weighted_mean([updates[p] for p in members], [p + 1.0 for p in members]))
        scaled = secagg_weights([p + 1 for p in members], max_weight=6.0)
        bound = max(
            bound, secagg_error_bound(scaled, SecAggSection().clipping_range, SecAggSection().quantization_range)
        )
    for key in state["global"]:
        expected = (group_means[0][key] + group_means[1][key]) / 2
        assert np.abs(state["global"][key] - expected).max() <= bound, key
    log = [r for r in _rows(run_dir) if r["round"] == 1 and r["node"] is not None]
    assert sorted(r["group"] for r in log) == ["g0"] * 3 + ["g1"] * 3 and all(r["accepted"] for r in log)


@pytest.mark.e2e
def test_a_secure_run_with_hostile_members_completes_every_round_refusing_their_groups(
    toymean, tiny_llama_dir, tmp_path
):
    """Nine clients in three SecAgg+ groups of three (partition id mod 3), through the real ServerApp and ClientApp.
    In round 1 partition 0 masks out-of-range values, partition 1 sends a masked vector one coordinate too long and
    partition 2 drops out after the share-keys stage: the run completes every round, round 1 refuses the three
    groups' aggregates and names each (the adapter stays where it was), and round 2, honest, trains every client."""
    run_dir = tmp_path / "run"
    settings = config(tiny_llama_dir, run_dir, secure=True, **{"toymean.groups": 3, "min-train-replies": 3})
    run(settings, nodes=9, hostile={"0": "shift", "1": "long", "2": "dropout"})
    rows = _rows(run_dir)
    first = next(r for r in rows if r["round"] == 1 and r["node"] is None)
    refused = first.get("aggregates_rejected", {})
    assert sorted(refused) == ["g0", "g1", "g2"], first
    assert "outside what 3 members" in refused["g0"] and "halted" in refused["g1"] and "halted" in refused["g2"]
    partition_of = {str(r["node"]): r["partition_id"] for r in rows if r["round"] == 0 and r["node"] is not None}
    reasons = {partition_of[node]: why for node, why in first["rejected"].items()}
    assert "masked" in reasons[1] and "dropped out" not in reasons[1], reasons
    assert not any(r.get("accepted") for r in rows if r["round"] == 1 and r["node"] is not None)
    second = [r for r in rows if r["round"] == 2 and r["node"] is not None]
    assert len(second) == 9 and all(r["accepted"] for r in second)
    assert "aggregates_rejected" not in next(r for r in rows if r["round"] == 2 and r["node"] is None)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_secure_group_of_fewer_than_three_is_not_trained():
    from common.reply_checks import ReplyLimits
    from server_app.secure import train_group_secure
    from strategies import Group

    start = {"w": np.zeros(2, np.float32)}
    pair = Group("pair", {1: start, 2: start})
    result = train_group_secure(None, None, 1, pair, SecAggSection(), ReplyLimits(examples_per_round=8))
    assert result.mean is None and set(result.rejected) == {1, 2} and "2 < 3" in result.rejected[1]


@pytest.mark.parametrize(
    ("size", "settings", "says"),
    [
        (2, {}, "2 < 3"),
        (3, {"num_shares": 4}, "num-shares=4 exceeds"),
        (4, {"num_shares": 4, "reconstruction_threshold": 5}, None),  # refused at config time already
        (3, {"reconstruction_threshold": 4}, "reconstruction-threshold=4 exceeds"),
        (3, {"quantization_range": 2**31}, "overflows"),
        (3, {}, ""),
    ],
)
def test_a_secure_group_that_would_leak_or_fail_in_flower_is_named_not_run(size, settings, says):
    from pydantic import ValidationError

    from server_app.secure import secure_group_problem

    try:
        cfg = SecAggSection.model_validate({k: v for k, v in settings.items() if k != "quantization_range"})
    except ValidationError:
        assert says is None
        return
    cfg = cfg.model_copy(update={k: v for k, v in settings.items() if k == "quantization_range"})  # beyond config
    problem = secure_group_problem(size, cfg)
    assert problem is None if says == "" else says in (problem or "")
