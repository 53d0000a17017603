"""VEMoE's math without Flower: responsibilities and routing, the responsibility-weighted aggregate from sums
(against explicit loops), and the pool decisions on crafted numbers."""

import numpy as np
import pytest
import torch

from common.adapters.experts import token_mixture
from strategies.vemoe.pool import (
    RESPONSIBILITY,
    VOTE,
    birth_slot,
    client_payload,
    delta_w,
    experts_from_sum,
    merge,
    merge_pairs,
    newborn,
    prune,
    slot_key,
)
from strategies.vemoe.routing import responsibilities, top_m

LAYER = "model.layers.0.self_attn.q_proj"


def expert(rng, scale=1.0):
    return {
        f"{LAYER}.lora_A.weight": (scale * rng.normal(size=(2, 4))).astype(np.float32),
        f"{LAYER}.lora_B.weight": (scale * rng.normal(size=(3, 2))).astype(np.float32),
    }


def test_responsibilities_are_a_softmax_of_minus_loss_over_live_slots():
    losses = np.array([1.0, 3.0, np.nan, 2.0])
    live = np.array([True, True, False, True])
    r = responsibilities(losses, live, temperature=0.5)
    expected = np.exp(-np.array([1.0, 3.0, 2.0]) / 0.5)
    assert r[2] == 0 and r.sum() == pytest.approx(1.0)
    assert r[[0, 1, 3]] == pytest.approx(expected / expected.sum())
    assert r[0] > r[3] > r[1]  # the expert with the lowest probe loss is the most responsible
    with pytest.raises(ValueError, match="finite"):
        responsibilities(np.array([1.0, np.inf]), np.array([True, True]), 1.0)
    with pytest.raises(ValueError, match="no live"):
        responsibilities(np.array([1.0]), np.array([False]), 1.0)


def test_top_m_takes_the_most_responsible_live_slots():
    r = np.array([0.1, 0.0, 0.4, 0.1, 0.4])
    assert top_m(r, 2).tolist() == [2, 4]
    assert top_m(r, 3).tolist() == [0, 2, 4]  # a tie goes to the lower slot
    assert top_m(r, 9).tolist() == [0, 2, 3, 4]  # never an empty slot
    even = np.full(4, 0.25)  # new experts: every client ties on them
    assert top_m(even, 2).tolist() == [0, 1]
    assert top_m(even, 2, tie_order=np.array([3, 1, 0, 2])).tolist() == [1, 3]  # a client's own order breaks ties
    assert top_m(r, 2, tie_order=np.array([4, 3, 2, 1, 0])).tolist() == [2, 4]  # it never overrides r


def test_token_mixture_goes_from_the_router_to_the_domain_mixture_as_gamma_grows():
    r = torch.tensor([0.7, 0.3])
    u = torch.tensor([[5.0, -5.0], [-5.0, 5.0]])
    sharp = token_mixture(r.log(), u, gamma=0.1)
    flat = token_mixture(r.log(), u, gamma=1e6)
    assert torch.allclose(sharp.sum(-1), torch.ones(2))
    assert sharp[0, 0] > 0.99 and sharp[1, 1] > 0.99  # the router decides per token
    assert torch.allclose(flat, r.expand(2, 2), atol=1e-4)  # every token gets r
    with pytest.raises(ValueError, match="router logits"):
        token_mixture(r.log(), torch.zeros(2, 3), 1.0)


def test_the_aggregate_from_the_payload_sum_is_the_responsibility_weighted_mean():
    rng = np.random.default_rng(0)
    k_max, template = 4, expert(rng)
    previous = [expert(rng) for _ in range(k_max)]
    clients = []
    for r in ([0.6, 0.4, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0], [0.2, 0.0, 0.8, 0.0]):
        r = np.array(r)
        trained = {k: expert(rng) for k in np.flatnonzero(r)}
        clients.append((r, trained, client_payload(trained, r, template)))
    assert len({tuple(sorted((k, v.shape) for k, v in p.items())) for _, _, p in clients}) == 1  # one shape
    total = {key: sum(p[key].astype(np.float64) for _, _, p in clients) for key in clients[0][2]}
    experts, totals = experts_from_sum(total, previous)
    assert totals == pytest.approx([0.8, 0.9, 1.3, 0.0])
    for k in range(3):
        for name in template:
            explicit = sum(r[k] * t[k][name] for r, t, _ in clients if k in t) / sum(r[k] for r, _, _ in clients)
            assert experts[k][name] == pytest.approx(explicit, rel=1e-5, abs=1e-6)
    assert experts[3] is previous[3]  # nobody was responsible for slot 3: it stays as it was
    mean = {key: value / 3 for key, value in total.items()}  # a group mean gives the same experts
    assert all(np.allclose(a[n], b[n]) for a, b in zip(experts_from_sum(mean, previous)[0], experts) for n in a)


def test_a_payload_refuses_what_the_server_could_not_divide_back():
    rng = np.random.default_rng(1)
    template = expert(rng)
    with pytest.raises(ValueError, match="sum to 1"):
        client_payload({0: template}, np.array([0.5, 0.2]), template)
    with pytest.raises(ValueError, match="no trained expert"):
        client_payload({0: template}, np.array([0.5, 0.5]), template)
    with pytest.raises(ValueError, match="free slot"):
        client_payload({0: template}, np.array([1.0, 0.0]), template, birth_slot=0, candidate=template)


def test_a_newborn_is_the_mean_of_the_voters_candidates():
    rng = np.random.default_rng(2)
    template, a, b = expert(rng), expert(rng), expert(rng)
    r = np.array([1.0, 0.0])
    payloads = [
        client_payload({0: template}, r, template, birth_slot=1, candidate=a),
        client_payload({0: template}, r, template, birth_slot=1, candidate=b),
        client_payload({0: template}, r, template),
    ]
    assert len({tuple(sorted(p)) for p in payloads}) == 1  # a vote does not change the payload's shape
    total = {key: sum(p[key] for p in payloads) for key in payloads[0]}
    assert total[VOTE][0] == 2 and total[RESPONSIBILITY].tolist() == [3.0, 0.0]
    born = newborn(total, total[VOTE][0], 1, template)
    assert all(np.allclose(born[n], (a[n] + b[n]) / 2) for n in template)
    assert all(np.allclose(total[slot_key(0, n)], 3 * template[n]) for n in template)  # slot 0 unaffected
    assert slot_key(1, "x") == "expert-1.x"


def test_prune_needs_patience_and_never_empties_the_pool():
    live = np.array([True, True, True, False])
    low = np.zeros(4, dtype=int)
    totals = np.array([2.0, 0.9, 0.05, 0.0])  # slot 2 holds 1.7 % of the mass
    live, low, pruned = prune(totals, live, low, threshold=0.05, patience=2)
    assert pruned == [] and low.tolist() == [0, 0, 1, 0]
    live, low, _ = prune(np.array([2.0, 0.9, 0.5, 0.0]), live, low, 0.05, 2)  # recovered: the count restarts
    assert low.tolist() == [0, 0, 0, 0]
    for _ in range(2):
        live, low, pruned = prune(totals, live, low, 0.05, 2)
    assert pruned == [2] and live.tolist() == [True, True, False, False]
    alone, _, pruned = prune(np.zeros(4), np.array([True, False, False, False]), np.array([5, 0, 0, 0]), 0.05, 2)
    assert alone.tolist() == [True, False, False, False] and pruned == []


def test_merge_finds_near_duplicates_and_weights_by_responsibility():
    rng = np.random.default_rng(3)
    a = expert(rng)
    twin = {n: v * 1.01 for n, v in a.items()}  # the same delta-W direction
    other = expert(rng)
    experts = [a, other, twin, expert(rng)]
    pairs = merge_pairs(experts, np.array([True, True, True, False]), threshold=0.95)
    assert [(k, m) for k, m, _ in pairs] == [(0, 2)] and pairs[0][2]["cosine"] == pytest.approx(1.0)
    merged = merge(a, twin, r_kept=3.0, r_merged=1.0)
    expected = 0.75 * delta_w(a) + 0.25 * delta_w(twin)
    np.testing.assert_allclose(delta_w(merged), expected, rtol=1e-5, atol=1e-6)


def test_the_functional_distance_merges_experts_that_serve_the_clients_alike_whatever_their_a():
    """Two experts with independent random A (delta-W cosine near 0) that every client's probe finds equally good are
    one function: distance 0 from the payload sum, merged; an expert that serves other clients is far; fresh experts
    (B = 0, tied on every probe) are never called alike."""
    from strategies.vemoe.pool import functional_distance, probe_report
    from strategies.vemoe.wire import GAP, MOVE

    rng = np.random.default_rng(7)
    experts = [expert(rng), expert(rng), expert(rng)]
    live = np.array([True, True, True])
    base = [3.0, 3.0, 3.0, 3.0]  # each client's probe loss with no expert routed
    probes = [[2.0, 2.0, 2.9], [2.5, 2.5, 2.95], [2.9, 2.9, 2.0], [2.8, 2.8, 2.1]]  # 0 and 1 alike, 2 serves others
    reports = [probe_report(np.array(loss), b) for loss, b in zip(probes, base)]
    gap_sum, move_sum = (sum(rep[key] for rep in reports) for key in (GAP, MOVE))
    d = functional_distance(gap_sum, move_sum)
    assert d[0, 1] == pytest.approx(0.0, abs=1e-6) and d[0, 2] > 0.5 and d[1, 2] == pytest.approx(d[0, 2])
    assert merge_pairs(experts, live, 0.95) == []  # by delta-W cosine, independent experts never look alike
    pairs = merge_pairs(experts, live, 0.95, d, max_distance=0.1)
    assert [(k, m) for k, m, _ in pairs] == [(0, 1)] and pairs[0][2]["distance"] == pytest.approx(0.0, abs=1e-6)
    assert merge_pairs(experts, live, 0.95, d, max_distance=0.0) == []  # 0: the functional rule is off
    fresh = sum(probe_report(np.array([3.0, 3.0, 3.0]), 3.0)[key] for key in (MOVE,))
    assert np.isnan(functional_distance(np.zeros(9), fresh)).all()  # round 1: a tie is not similarity
    capped = probe_report(np.array([1.0, 9.0, np.nan]), 9.5)  # a free slot reports nothing; values capped
    assert capped[GAP].reshape(3, 3)[0, 1] == 4.0 and capped[MOVE].tolist() == [4.0, 0.5, 0.0]
    assert not capped[GAP].reshape(3, 3)[:, 2].any()


def test_a_merged_expert_computes_the_mean_delta_w_not_the_mean_of_its_factors():
    """Two experts with independent random A (as every slot starts): the array-by-array mean of A and B is not what
    the two compute on average; the merge is, exactly when the mean fits the slot's rank, else its best rank-r
    approximation."""
    rng = np.random.default_rng(5)
    b = rng.normal(size=(3, 2))
    first = {f"{LAYER}.lora_A.weight": rng.normal(size=(2, 4)), f"{LAYER}.lora_B.weight": b}
    second = {f"{LAYER}.lora_A.weight": first[f"{LAYER}.lora_A.weight"], f"{LAYER}.lora_B.weight": -0.5 * b}
    target = 0.5 * delta_w(first) + 0.5 * delta_w(second)  # shared A: the mean has rank 2, the slot's rank
    np.testing.assert_allclose(delta_w(merge(first, second, 1.0, 1.0)), target, atol=1e-6)
    one, other = expert(rng), expert(rng)  # independent A: the mean dW has rank up to 4 > 2
    target = 0.5 * delta_w(one) + 0.5 * delta_w(other)
    naive = {n: 0.5 * one[n] + 0.5 * other[n] for n in one}
    merged = merge(one, other, 1.0, 1.0)
    ours, theirs = (np.linalg.norm(delta_w(x) - target) for x in (merged, naive))
    matrix = target.reshape(3, 4)
    best = np.sqrt(np.sum(np.linalg.svd(matrix, compute_uv=False)[2:] ** 2))  # Eckart-Young: the rank-2 optimum
    assert ours == pytest.approx(best, rel=1e-4) and ours < theirs
    assert {n: v.shape for n, v in merged.items()} == {n: v.shape for n, v in one.items()}


def test_the_pool_never_exceeds_k_max():
    rng = np.random.default_rng(4)
    k_max, live, low = 5, np.array([True, True, False, False, False]), np.zeros(5, dtype=int)
    births = 0
    for _ in range(200):
        slot = birth_slot(votes=int(rng.integers(0, 4)), live=live, min_votes=2)
        if slot is not None:
            assert not live[slot]
            live[slot], births = True, births + 1
        totals = np.where(live, rng.exponential(size=k_max) * (rng.random(k_max) > 0.3), 0.0)
        live, low, _ = prune(totals, live, low, threshold=0.1, patience=2)
        assert 1 <= live.sum() <= k_max
    assert births > k_max  # slots were freed and reused
    assert birth_slot(votes=10, live=np.ones(k_max, dtype=bool), min_votes=2) is None


def test_separation_is_the_purity_of_each_rounds_top1_experts_against_the_clients_task_sets():
    from strategies.vemoe.separation import purity, separation

    assert purity([0, 0, 1, 1], ["a", "a", "b", "b"]) == 1.0
    assert purity([0, 0, 0, 0], ["a", "a", "b", "b"]) == 0.5  # one expert serves everyone
    assert purity([0, 1, 0, 1], ["a", "a", "b", "b"]) == 0.5
    rows = [
        {"round": 1, "node": 10 + p, "partition_id": p, "vemoe_r": r, "tasks": t}
        for p, (r, t) in enumerate([([0.6, 0.4], "a"), ([0.7, 0.3], "a"), ([0.2, 0.8], "b"), ([0.5, 0.5], "b")])
    ] + [{"round": 1, "node": None}]
    (first,) = separation(rows)
    assert first["top1"] == {0: 0, 1: 0, 2: 1, 3: 0} and first["purity"] == 0.75  # a tie goes to the lower slot


def test_a_round_one_tie_is_broken_by_each_experts_gradient_gain():
    from strategies.vemoe.routing import gain_shares, tied

    live = np.array([True, True, True, False])
    assert tied(np.array([2.5, 2.5, 2.5, np.nan]), live)
    assert not tied(np.array([2.5, 2.4, 2.5, np.nan]), live)
    r = gain_shares(np.array([1.0, 3.0, 0.0, 9.0]), live)  # a free slot's gain is never counted
    assert r.tolist() == [0.25, 0.75, 0.0, 0.0]
    assert gain_shares(np.zeros(4), live).tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0])


def test_summed_likelihood_responsibilities_are_the_posterior_with_the_prior():
    live = np.array([True, True, False])
    nll = np.array([40.0, 42.0, np.nan])  # summed over the probe's answer tokens
    r = responsibilities(nll, live, 1.0, prior=np.array([0.5, 0.5, 0.0]))
    assert r[0] == pytest.approx(1 / (1 + np.exp(-2.0))) and r[2] == 0  # e^-40 / (e^-40 + e^-42)
    tilted = responsibilities(nll, live, 1.0, prior=np.array([0.1, 0.9, 0.0]))
    assert tilted[1] / tilted[0] == pytest.approx(9 * np.exp(-2.0))
    mean = responsibilities(nll / 20, live, 0.5)  # the same probe as a mean over 20 tokens, seed 002's T
    assert r.max() > mean.max()  # summed: sharper
    assert responsibilities(nll, live, 1.0, prior=np.zeros(3)).tolist() == pytest.approx(r.tolist())  # no mass


def test_an_oracle_client_routes_to_its_categorys_expert_alone_and_a_bad_oracle_is_refused():
    from types import SimpleNamespace

    from common.config import ConfigError
    from strategies import load_run_config
    from strategies.vemoe.client import VEMoEClient

    cfg = load_run_config({"strategy": "vemoe", "vemoe.oracle": "question generation=0,answer generation=2"})
    client = VEMoEClient(cfg)
    client.live = np.array([True, True, True] + [False] * (len(client.live) - 3))
    rt = SimpleNamespace(tasks="answer generation")
    assert client._responsibilities(rt, np.zeros(len(client.live))).tolist()[:4] == [0, 0, 1, 0]
    with pytest.raises(ConfigError, match="vemoe.oracle"):
        load_run_config({"strategy": "vemoe", "vemoe.oracle": "question generation=5"})


def test_a_client_no_expert_serves_distinctively_votes_for_a_birth():
    from strategies.vemoe.routing import unserved

    live = np.array([True, True, True, False])
    flat, sharp = np.array([0.34, 0.33, 0.33, 0.0]), np.array([0.9, 0.05, 0.05, 0.0])
    assert unserved(flat, live, 0.9) and not unserved(sharp, live, 0.9)
    assert not unserved(flat, live, 0.0)  # off
    assert not unserved(np.array([1.0, 0, 0, 0]), np.array([True, False, False, False]), 0.9)  # one expert: no choice
