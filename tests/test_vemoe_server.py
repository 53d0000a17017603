"""VEMoE's server half without Flower: one group of everyone, experts from the group mean, and the open-world
events (prune, merge, birth) from crafted payloads; checkpoint round trip."""

import json

import numpy as np
import pytest

from common.adapters.experts import ExpertsSection
from common.adapters.experts.adapter import join_slots, split_slots
from strategies.base import ClientInfo, GroupResult
from strategies.vemoe.config import VemoeSection
from strategies.vemoe.pool import RESPONSIBILITY, client_payload
from strategies.vemoe.server import VEMoE

LAYER = "model.layers.0.self_attn.q_proj"
K = 4


def expert(rng, scale=1.0):
    return {
        f"{LAYER}.lora_A.weight": (scale * rng.normal(size=(2, 6))).astype(np.float32),
        f"{LAYER}.lora_B.weight": (scale * rng.normal(size=(5, 2))).astype(np.float32),
    }


@pytest.fixture
def server():
    rng = np.random.default_rng(0)
    strategy = VEMoE(
        ExpertsSection(k_max=K, r=2, top_m=2),
        VemoeSection(k_init=2, birth_min_votes=2, prune_threshold=0.1, prune_patience=2, merge_threshold=0.99),
    )
    initial = join_slots([expert(rng) for _ in range(K)])
    strategy.initialise({nid: ClientInfo(nid, nid, "smol", initial) for nid in (11, 12, 13)})
    return strategy


def mean_of(payloads):
    return {k: np.mean([p[k] for p in payloads], axis=0).astype(np.float32) for k in payloads[0]}


def test_every_client_is_one_group_sent_the_pool_and_the_birth_slot(server):
    (group,) = server.train_groups(1, [11, 12, 13, 99])  # 99 never answered the initial query
    assert group.members == [11, 12, 13] and group.weight_by == "equal"
    assert (
        group.start[11][RESPONSIBILITY].tolist() == [1, 1, 0, 0] and group.config.wire()["vemoe-birth-slot"] == 2
    )  # as it travels


def test_the_update_is_the_responsibility_weighted_mean_and_a_birth_takes_the_free_slot(server):
    rng = np.random.default_rng(1)
    template = server.experts[0]
    trained = [{0: expert(rng), 1: expert(rng)} for _ in range(3)]
    rs = [np.array([0.7, 0.3, 0, 0]), np.array([0.2, 0.8, 0, 0]), np.array([1.0, 0, 0, 0])]
    candidates = [expert(rng), expert(rng)]
    payloads = [
        client_payload(trained[0], rs[0], template, birth_slot=2, candidate=candidates[0]),
        client_payload(trained[1], rs[1], template, birth_slot=2, candidate=candidates[1]),
        client_payload({0: trained[2][0]}, rs[2], template),
    ]
    server.update(1, [GroupResult("pool", mean_of(payloads), 3.0, [11, 12, 13])])
    for k in (0, 1):
        total = sum(r[k] for r in rs)
        for name in template:
            explicit = sum(r[k] * t[k][name] for r, t in zip(rs, trained) if r[k]) / total
            assert server.experts[k][name] == pytest.approx(explicit, rel=1e-4, abs=1e-5)
    assert server.live.tolist() == [True, True, True, False]  # two votes: slot 2 is born
    assert all(
        np.allclose(server.experts[2][n], (candidates[0][n] + candidates[1][n]) / 2, atol=1e-6) for n in template
    )
    (event,) = server.report()["vemoe"]["events"]
    assert event["kind"] == "birth" and event["slot"] == 2 and event["votes"] == pytest.approx(2.0)


def test_an_unused_expert_is_pruned_after_its_patience_and_duplicates_merge(server):
    rng = np.random.default_rng(2)
    template = server.experts[0]
    twin = expert(rng)
    near = {n: v * 1.001 for n, v in twin.items()}
    for round_ in (1, 2):
        payloads = [client_payload({0: twin, 1: near}, np.array([0.5, 0.5, 0, 0]), template) for _ in range(3)]
        server.update(round_, [GroupResult("pool", mean_of(payloads), 3.0, [11, 12, 13])])
        kinds = [e["kind"] for e in server.report()["vemoe"]["events"]]
        if round_ == 1:
            assert kinds == ["merge"] and server.live.tolist() == [True, False, False, False]
    assert server.live.sum() == 1  # the pool never empties
    server.live[:] = [True, True, False, False]
    server.low_rounds[:] = 0
    for round_ in (3, 4):
        payloads = [client_payload({0: expert(rng)}, np.array([1.0, 0, 0, 0]), template) for _ in range(3)]
        server.update(round_, [GroupResult("pool", mean_of(payloads), 3.0, [11, 12, 13])])
    events = server.report()["vemoe"]["events"]
    assert [(e["kind"], e["slot"]) for e in events] == [("prune", 1)] and server.live.tolist()[:2] == [True, False]


def test_the_checkpoint_restores_the_pool_and_its_slots(server):
    server.live[:] = [True, False, True, False]
    server.low_rounds[:] = [0, 0, 1, 0]
    state = server.state_dict()
    fresh = VEMoE(server.pool_cfg, server.cfg)
    fresh.load_state_dict(state)
    assert fresh.live.tolist() == [True, False, True, False] and fresh.low_rounds.tolist() == [0, 0, 1, 0]
    assert all(np.array_equal(a[n], b[n]) for a, b in zip(fresh.experts, server.experts) for n in a)
    assert len(split_slots(server.final_adapters()[0].arrays, K)) == K


def test_clients_of_another_base_model_are_refused(server):
    rng = np.random.default_rng(3)
    other = join_slots(
        [
            {f"{LAYER}.lora_A.weight": rng.normal(size=(2, 9)), f"{LAYER}.lora_B.weight": rng.normal(size=(5, 2))}
            for _ in range(K)
        ]
    )
    with pytest.raises(ValueError, match="one pool"):
        server.initialise({20: ClientInfo(20, 20, "qwen", other)})


def test_the_run_plots_are_drawn_and_negative_transfer_needs_a_baseline(server, tmp_path, monkeypatch):
    from common.plots import final_losses

    def client_rows(losses, node_base=0):
        return [
            {"round": r, "node": node_base + p, "partition_id": p, "tasks": "t", "eval_loss": loss}
            for r, per_client in enumerate(losses)
            for p, loss in enumerate(per_client)
        ]

    pool_rows = [
        {"round": 1, "node": None, "vemoe": {"responsibility": [2.0, 1.0, 0, 0], "experts": 2, "events": []}},
        {
            "round": 2,
            "node": None,
            "vemoe": {
                "responsibility": [2.5, 0.1, 0.4, 0],
                "experts": 3,
                "events": [{"round": 2, "kind": "birth", "slot": 2, "votes": 2.0}],
            },
        },
    ]
    rows = pool_rows + client_rows([[3.0, 2.0, 1.0], [2.5, 1.9, 1.2], [2.0, 1.8, 1.3]])
    assert final_losses(rows) == {0: 2.0, 1: 1.8, 2: 1.3}
    paths = server.plot_run(rows, tmp_path)  # no vemoe.baseline-run: two figures
    assert sorted(p.name for p in paths) == ["expert_utilization.png", "worst_client.png"]
    baseline = tmp_path / "local"
    baseline.mkdir()
    (baseline / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in client_rows([[3.0, 2.0, 1.0], [2.2, 1.7, 1.1]]))
    )
    # a relative vemoe.baseline-run resolves as run-dir does (the ServerApp's working directory is Flower's choice)
    monkeypatch.setenv("TESSERA_RUN_ROOT", str(tmp_path))
    monkeypatch.chdir(baseline)
    server.cfg = server.cfg.model_copy(update={"baseline_run": "local"})
    paths = server.plot_run(rows, tmp_path)
    assert (tmp_path / "negative_transfer.png").stat().st_size > 0 and len(paths) == 3


def test_with_summed_likelihood_the_server_sends_a_counted_prior_that_never_zeroes_a_live_expert():
    rng = np.random.default_rng(0)
    strategy = VEMoE(ExpertsSection(k_max=K, r=2, top_m=2), VemoeSection(k_init=2, likelihood="summed"))
    strategy.initialise(
        {nid: ClientInfo(nid, nid, "smol", join_slots([expert(rng) for _ in range(K)])) for nid in (1, 2)}
    )
    (group,) = strategy.train_groups(1, [1, 2])
    assert [float(x) for x in group.config.wire()["vemoe-prior"].split(",")] == [0.5, 0.5, 0, 0]  # round 1: uniform
    strategy.totals = np.array([3.0, 0.0, 0.0, 0.0])  # last round every client chose expert 0
    (group,) = strategy.train_groups(2, [1, 2])
    assert [float(x) for x in group.config.wire()["vemoe-prior"].split(",")] == pytest.approx([0.8, 0.2, 0, 0])
    plain = VEMoE(ExpertsSection(k_max=K, r=2, top_m=2), VemoeSection(k_init=2, likelihood="mean"))
    plain.initialise({1: ClientInfo(1, 1, "smol", join_slots([expert(rng) for _ in range(K)]))})
    assert "vemoe-prior" not in plain.train_groups(1, [1])[0].config.wire()  # seed 002's softmax (mean) needs none


def test_experts_the_clients_probes_find_alike_merge_by_functional_distance():
    """Two experts with independent random A (delta-W cosine far below the threshold) that every client's probe
    finds equally good merge when ``vemoe.merge-distance`` is on; the event carries the distance, the report every
    measured pair's; with it off (the default), nothing merges."""
    for merge_distance, merges in ((0.1, True), (0.0, False)):
        rng = np.random.default_rng(3)
        strategy = VEMoE(
            ExpertsSection(k_max=K, r=2, top_m=2),
            VemoeSection(k_init=3, merge_threshold=0.99, merge_distance=merge_distance),
        )
        strategy.initialise(
            {nid: ClientInfo(nid, nid, "smol", join_slots([expert(rng) for _ in range(K)])) for nid in (11, 12, 13)}
        )
        template = strategy.experts[0]
        probes = [[2.0, 2.02, 2.9, np.nan], [2.5, 2.49, 2.95, np.nan], [2.9, 2.9, 2.0, np.nan]]
        payloads = [
            client_payload(
                {0: expert(rng), 2: expert(rng)}, np.array([0.5, 0, 0.5, 0]), template, probe=(np.array(p), 3.0)
            )
            for p in probes
        ]
        strategy.update(1, [GroupResult("pool", mean_of(payloads), 3.0, [11, 12, 13])])
        report = strategy.report()["vemoe"]
        assert set(report["distance"]) == {"0,1", "0,2", "1,2"} and report["distance"]["0,1"] < 0.05
        events = [(e["kind"], e["slot"], e.get("into")) for e in report["events"]]
        assert events == ([("merge", 1, 0)] if merges else []), events
        assert strategy.live.tolist() == ([True, False, True, False] if merges else [True, True, True, False])
