"""Strategies check the sums they divide by before using them (hostile members, round two): a VEMoE member that
votes 8 or sends a responsibility of -8, and an ATLAS member whose rank mask shrinks a slot's mean mask to almost
nothing, pass the box and norm checks; the sum they leave cannot come from honest members, so it is refused, the
group's round is lost (named) and nothing is divided by it."""

from __future__ import annotations

import numpy as np
import pytest
from test_vemoe_server import K, expert, mean_of

from common.adapters.experts import ExpertsSection
from common.adapters.experts.adapter import join_slots
from common.adapters.lora import ranks as lora_ranks
from server_app.offenders import refuse_unsound_sums
from strategies.atlas.ranks import mask_problem
from strategies.base import ClientInfo, GroupResult
from strategies.vemoe.config import VemoeSection
from strategies.vemoe.pool import client_payload, sum_problem
from strategies.vemoe.server import VEMoE
from strategies.vemoe.wire import GAP, MOVE, RESPONSIBILITY, VOTE


@pytest.fixture
def vemoe_server():
    strategy = VEMoE(ExpertsSection(k_max=K, r=2, top_m=2), VemoeSection(k_init=2, birth_min_votes=2))
    initial = join_slots([expert(np.random.default_rng(k)) for k in range(K)])
    strategy.initialise({nid: ClientInfo(nid, nid, "smol", initial) for nid in (11, 12, 13)})
    return strategy


def honest_payloads(server, rng):
    template = server.experts[0]
    rs = [np.array([0.7, 0.3, 0, 0]), np.array([0.2, 0.8, 0, 0]), np.array([1.0, 0, 0, 0])]
    return [client_payload({0: expert(rng), 1: expert(rng)}, r, template) for r in rs]


def total(payloads):
    return {k: np.sum([p[k] for p in payloads], axis=0) for k in payloads[0]}


def test_honest_vemoe_sums_pass(vemoe_server):
    payloads = honest_payloads(vemoe_server, np.random.default_rng(0))
    assert sum_problem(total(payloads), 3, vemoe_server.live) is None


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        (lambda p: {**p, VOTE: np.array([8.0], np.float32)}, "birth votes"),
        (lambda p: {**p, VOTE: np.array([0.5], np.float32)}, "birth votes"),
        (lambda p: {**p, RESPONSIBILITY: np.array([-8.0, 9.0, 0, 0], np.float32)}, "outside"),
        (lambda p: {**p, RESPONSIBILITY: np.array([0.5, 0.0, 0.5, 0], np.float32)}, "free slot"),
        (lambda p: {**p, RESPONSIBILITY: np.array([2.0, 1.0, 0, 0], np.float32)}, "sum to"),
        # a probe gap of -1e3 would make two experts look alike (a merge by the functional distance)
        (lambda p: {**p, GAP: np.full(16, -1e3, np.float32)}, "probe gap"),
        (lambda p: {**p, MOVE: np.full(4, 1e3, np.float32)}, "probe move"),
    ],
)
def test_a_vemoe_sum_no_honest_members_send_is_refused_and_the_pool_kept(vemoe_server, tamper, says):
    payloads = honest_payloads(vemoe_server, np.random.default_rng(0))
    payloads[2] = tamper(payloads[2])
    assert says in (sum_problem(total(payloads), 3, vemoe_server.live) or "")
    before = [dict(e) for e in vemoe_server.experts]
    live = vemoe_server.live.copy()
    result = GroupResult("pool", mean_of(payloads), 3.0, [11, 12, 13])
    refuse_unsound_sums(vemoe_server, 1, [result])  # as the ServerApp does before every update
    vemoe_server.update(1, [result])
    assert result.aggregate_rejected is not None and says in result.aggregate_rejected  # named in the round's row
    assert (vemoe_server.live == live).all()
    assert all(np.array_equal(e[k], b[k]) for e, b in zip(vemoe_server.experts, before) for k in b)


def atlas_mean(masks: list[np.ndarray], weights: list[float]) -> dict[str, np.ndarray]:
    key = lora_ranks.MASK_PREFIX + "x"
    return {key: sum(w * m for w, m in zip(weights, masks)) / sum(weights)}


def test_an_atlas_mask_sum_shrunk_by_one_member_is_refused_and_honest_ones_pass():
    weights = [12.0, 12.0, 12.0, 12.0]
    honest = [np.array([1.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0]), np.array([1.0, 1.0, 1.0]), np.array([1.0, 0, 0])]
    assert mask_problem(atlas_mean(honest, weights), weights) is None
    # slot 1: clients 0 and 2 have it (a mask sum of 2); the fourth sends -2 + 0.004: a mean mask of 0.001, not 0.5
    hostile = honest[:3] + [np.array([1.0, -2.0 + 0.004, 0.0])]
    assert "below the least member's share" in (mask_problem(atlas_mean(hostile, weights), weights) or "")
    assert "outside [0, 1]" in (mask_problem(atlas_mean(honest[:3] + [np.array([9.0, 1, 0])], weights), weights) or "")


def test_an_atlas_group_whose_mask_sum_is_refused_keeps_its_adapter_and_names_why():
    from test_atlas_strategy import PEFT, ranked_atlas

    strategy = ranked_atlas([0.1, 0.03, 0.1, 0.03], [0, 0, 0, 0], clustering="oracle")
    (group,) = strategy.train_groups(1, [100, 101, 102, 103])
    before = {k: v.copy() for k, v in strategy.eval_arrays(100).items()}
    mean = {k: np.mean([group.start[n][k] for n in group.members], axis=0) for k in group.start[100]}
    mask = "rank-mask.model.layers.0.self_attn.q_proj"
    mean[mask] = np.full_like(mean[mask], 0.001)  # one member's mask of -(n - 1) + e
    mean[PEFT.format(0, "A")] = mean[PEFT.format(0, "A")] + 0.05
    members = {n: {"num_examples": 12} for n in group.members}
    result = GroupResult(group.name, mean, 48.0, group.members, metrics=members)
    refuse_unsound_sums(strategy, 1, [result])
    strategy.update(1, [result])
    assert result.aggregate_rejected is not None and "below the least member's share" in result.aggregate_rejected
    after = strategy.eval_arrays(100)
    assert all(np.array_equal(after[k], before[k]) for k in before)  # what client 0 is sent has not moved


def test_model_names_never_share_a_family_key():
    from strategies.families import family_key

    names = ["Qwen_X", "Qwen/X", "Qwen X", "Qwen_2f_X", "qwen/x", "smollm2-135m-instruct", "/models/a_b", "/models/a/b"]
    assert len({family_key(n) for n in names}) == len(names)
    assert family_key("smollm2-135m-instruct") == "smollm2-135m-instruct"  # aliases keep their state names
    assert all(
        set(family_key(n)) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") for n in names
    )
