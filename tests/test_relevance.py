import math

import numpy as np
import pytest
import torch

from strategies.aggregation import group_by_relevance, group_weights, mix_group_means, personalised_mix
from strategies.simgrad.relevance import (
    cosine_relevance,
    relevance_weights,
    route_blocks,
    row_softmax,
    within_across_relevance,
)
from strategies.simgrad.signatures import count_sketch, probe_gradient, sanitize_signature


# --- seed 001 toy (FedMosaic / SimGrad notebook), re-implemented with plain loops as an independent reference ---
def toy_cosine(a, b):
    a, b = list(np.ravel(a)), list(np.ravel(b))
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb + 1e-12)


def toy_softmax_rows(x, tau):
    out = []
    for row in x:
        top = max(v / tau for v in row)
        e = [math.exp(v / tau - top) for v in row]
        out.append([v / sum(e) for v in e])
    return np.array(out)


def random_clients(n=5, r=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"P": rng.normal(size=(r, r)).astype(np.float32), "Q": rng.normal(size=(r,)).astype(np.float32)}
        for _ in range(n)
    ]


def test_seed001_toy_reference():
    rng = np.random.default_rng(1)
    sig = rng.normal(size=(5, 7))
    n, tau = 5, 0.5
    S_ref = np.array([[toy_cosine(sig[i], sig[j]) for j in range(n)] for i in range(n)])
    np.testing.assert_allclose(cosine_relevance(sig), S_ref, rtol=1e-12, atol=1e-12)
    W_ref = toy_softmax_rows(S_ref, tau)
    np.testing.assert_allclose(row_softmax(S_ref, tau), W_ref, rtol=1e-12)
    np.testing.assert_allclose(relevance_weights(sig, tau), W_ref, rtol=1e-10)
    local = random_clients(n)
    mixed = personalised_mix(W_ref, local)
    for i in range(n):
        for key in ("P", "Q"):
            ref = sum(W_ref[i, j] * local[j][key].astype(np.float64) for j in range(n))
            np.testing.assert_allclose(mixed[i][key], ref, rtol=1e-5, atol=1e-6)
            assert mixed[i][key].dtype == np.float32


def test_cosine_diagonal_and_zero_rows_and_softmax_checks():
    sig = np.array([[1e-9, 0.0], [0.0, 0.0], [3.0, 4.0]])
    S = cosine_relevance(sig)
    assert S[0, 0] == 1.0 and S[2, 2] == 1.0 and np.all(S[1] == 0)
    assert np.allclose(row_softmax(np.array([[1000.0, 0.0]]), 1.0), [[1.0, 0.0]])
    for tau in (0.0, -1.0):
        with pytest.raises(ValueError):
            row_softmax(S, tau)
    np.testing.assert_array_equal(relevance_weights(sig, 1.0, "uniform"), np.full((3, 3), 1 / 3))
    np.testing.assert_array_equal(relevance_weights(sig, 1.0, "local-only"), np.eye(3))
    with pytest.raises(ValueError):
        relevance_weights(sig, 1.0, "nope")


def test_personalised_mix_renormalises_over_providers():
    w = row_softmax(np.random.default_rng(2).normal(size=(3, 3)), 1.0)
    updates = [
        {"a": np.full(2, 1.0), "b": np.full(2, 5.0)},
        {"a": np.full(2, 3.0)},
        {"a": np.full(2, 7.0), "b": np.full(2, 9.0)},
    ]
    out = personalised_mix(w, updates)
    for i in range(3):
        assert np.allclose(out[i]["a"], (w[i] @ [1.0, 3.0, 7.0]) / w[i].sum())
        assert np.allclose(out[i]["b"], (w[i, 0] * 5 + w[i, 2] * 9) / (w[i, 0] + w[i, 2]))  # client 1 does not dilute
    # client 2 sent "b" but marks it unavailable (e.g. untrained block): it is ignored; "c" was never sent
    out = personalised_mix(w, updates, available=[{"a", "b"}, {"a"}, {"a"}])
    assert all(np.allclose(o["b"], 5.0) for o in out) and all("c" not in o for o in out)
    out = personalised_mix(w, [{"a": np.ones(1)}, {}, {}], available=[set(), set(), set()])
    assert out == [{}, {}, {}]
    # local-only: a client that sent nothing for a name gets nothing for it (keeps its own)
    out = personalised_mix(np.eye(3), updates)
    assert "b" not in out[1] and np.allclose(out[0]["b"], 5.0)
    with pytest.raises(ValueError):
        personalised_mix(w, updates, available=[{"a", "z"}, {"a"}, {"a"}])


def planted(families, within=0.9, across=0.1, noise=0.02, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.asarray(families)
    s = np.where(labels[:, None] == labels[None, :], within, across) + noise * rng.normal(size=(len(labels),) * 2)
    s = (s + s.T) / 2
    np.fill_diagonal(s, 1.0)
    return s


def test_group_by_relevance_recovers_planted_families():
    families = ["x", "y", "x", "y", "y", "x"]
    assert group_by_relevance(planted(families), min_size=3) == [[0, 2, 5], [1, 3, 4]]
    fams = ["a", "b"] * 4
    groups = group_by_relevance(planted(fams, seed=1), min_size=2)
    assert all(len({fams[i] for i in g}) == 1 for g in groups)  # smaller groups never mix families
    assert group_by_relevance(np.eye(2), min_size=3) == [[0, 1]]
    # ties go to the lowest-index pair, and a full group may still absorb a small cluster: ({0,1},{2}) beats ({2},{3})
    assert group_by_relevance(np.zeros((4, 4)), min_size=2) == [[0, 1, 2, 3]]
    assert group_by_relevance(np.zeros((3, 3)), min_size=1) == [[0], [1], [2]]


@pytest.mark.parametrize("n", range(3, 11))
def test_group_by_relevance_sizes_and_partition(n):
    for seed in range(3):
        s = np.random.default_rng(seed * 100 + n).normal(size=(n, n))
        groups = group_by_relevance(s, min_size=3)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert all(len(g) >= 3 and g == sorted(g) for g in groups)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_mix_group_means_equals_personalised_mix_for_groupwise_constant_weights():
    n, groups = 7, [[0, 3, 5], [1, 2], [4, 6]]
    rng = np.random.default_rng(3)
    c = rng.uniform(0.1, 1.0, size=(n, len(groups)))
    w = np.zeros((n, n))
    for g, members in enumerate(groups):
        w[:, members] = c[:, [g]]
    w /= w.sum(axis=1, keepdims=True)
    updates = random_clients(n, seed=4)
    means = [{k: np.mean([updates[j][k] for j in g], axis=0) for k in ("P", "Q")} for g in groups]
    exact, secure = personalised_mix(w, updates), mix_group_means(w, groups, means)
    for i in range(n):
        for key in ("P", "Q"):
            np.testing.assert_allclose(secure[i][key], exact[i][key], rtol=1e-5, atol=1e-6)


def test_mix_group_means_general_formula_and_missing_groups():
    n, groups = 6, [[0, 1, 2], [3, 4, 5]]
    w = row_softmax(np.random.default_rng(5).normal(size=(n, n)), 0.5)
    wg = group_weights(w, groups)
    np.testing.assert_allclose(wg, np.stack([w[:, :3].sum(1), w[:, 3:].sum(1)], axis=1))
    np.testing.assert_allclose(wg.sum(axis=1), 1.0)
    means = [{"a": np.array([1.0, 2.0]), "b": np.array([4.0])}, {"a": np.array([3.0, -1.0])}]
    out = mix_group_means(w, groups, means)
    for i in range(n):
        np.testing.assert_allclose(
            out[i]["a"], (wg[i, 0] * means[0]["a"] + wg[i, 1] * means[1]["a"]) / wg[i].sum(), rtol=1e-6
        )
        np.testing.assert_allclose(out[i]["b"], [4.0])  # only group 0 holds "b": renormalised over it
    out = mix_group_means(w, groups, [None, {"a": np.array([3.0, -1.0])}])
    assert all(np.allclose(o["a"], [3.0, -1.0]) and "b" not in o for o in out)
    assert mix_group_means(w, groups, [None, None]) == [{}] * n


def test_route_blocks():
    s = np.array([0.5, 2.0, 2.0, np.nan, 1.0, 2.0])
    assert route_blocks(s, 1) == [3]  # NaN = unknown = +inf
    assert route_blocks(s, 2) == [1, 3]  # ties to the lower index
    assert route_blocks(s, 3) == [1, 2, 3]
    assert route_blocks(s, 5) == [1, 2, 3, 4, 5]
    assert route_blocks(s, 0) == route_blocks(s, 6) == route_blocks(s, 99) == route_blocks(s, -1) == list(range(6))


def test_within_across_relevance():
    families = ["a", "a", "b", "b", "b"]
    s = np.array(
        [
            [1, 0.8, 0.1, 0.2, 0.0],
            [0.8, 1, 0.1, 0.1, 0.1],
            [0.1, 0.1, 1, 0.6, 0.7],
            [0.2, 0.1, 0.6, 1, 0.5],
            [0.0, 0.1, 0.7, 0.5, 1],
        ]
    )
    within, across = within_across_relevance(s, families)
    assert within == pytest.approx((0.8 + 0.6 + 0.7 + 0.5) / 4)
    assert across == pytest.approx((0.1 + 0.2 + 0.0 + 0.1 + 0.1 + 0.1) / 6)
    w, a = within_across_relevance(np.eye(3), ["a", "b", "c"])
    assert math.isnan(w) and a == 0.0
    w, a = within_across_relevance(np.ones((2, 2)), ["a", "a"])
    assert w == 1.0 and math.isnan(a)


def test_sanitize_signature():
    rng = np.random.default_rng(0)
    g = rng.normal(size=1000).astype(np.float32)
    sig, ema = sanitize_signature(g, None, 0.9, 0.0, 1.0, np.random.default_rng(1))
    np.testing.assert_array_equal(sig, g)
    np.testing.assert_array_equal(ema, g)
    assert sig.dtype == np.float32
    sig, _ = sanitize_signature(g, None, 0.5, 0.3, 0.25, np.random.default_rng(1))
    assert np.count_nonzero(sig) == 250
    sig, _ = sanitize_signature(g[:3], None, 0.5, 0.0, 0.01, np.random.default_rng(1))
    assert np.count_nonzero(sig) == 1  # at least one coordinate survives
    sig, _ = sanitize_signature(g, None, 0.0, 0.5, 1.0, np.random.default_rng(2))
    assert np.std(sig - g) == pytest.approx(
        0.5 * np.sqrt(np.mean(g.astype(np.float64) ** 2)), rel=0.1
    )  # relative noise
    grads, ema, ref = [rng.normal(size=50) for _ in range(4)], None, None
    for step, grad in enumerate(grads):
        _, ema = sanitize_signature(grad, ema, 0.7, 0.1, 0.5, np.random.default_rng(step))
        ref = grad if ref is None else 0.7 * ref + 0.3 * grad
        np.testing.assert_allclose(ema, ref, rtol=1e-12)
    for bad in ({"decay": 1.0}, {"decay": -0.1}, {"keep_fraction": 0.0}, {"keep_fraction": 1.5}, {"noise_scale": -1.0}):
        args = {"decay": 0.5, "noise_scale": 0.1, "keep_fraction": 0.5} | bad
        with pytest.raises(ValueError):
            sanitize_signature(g, None, rng=np.random.default_rng(0), **args)


def test_count_sketch_is_shared_by_seed():
    b1, s1 = count_sketch(100, 8, seed=7)
    b2, s2 = count_sketch(100, 8, seed=7)
    np.testing.assert_array_equal(b1, b2)
    np.testing.assert_array_equal(s1, s2)
    assert b1.min() >= 0 and b1.max() < 8 and set(np.unique(s1)) == {-1.0, 1.0}
    assert not np.array_equal(count_sketch(100, 8, seed=8)[0], b1)


def test_probe_gradient_matches_autograd_sketch(tiny_llama_dir):
    from common.data import Example
    from common.model import load_base_model, load_tokenizer
    from common.training import IGNORE, collate, encode

    model = load_base_model(str(tiny_llama_dir), "fp32", "cpu")
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    examples = [
        Example("math", "What is 2 + 2?", "4"),
        Example("math", "Name a prime number bigger than ten, please.", "Eleven is a prime number."),
        Example("qa", "Capital of France?", "Paris"),
    ]
    buckets, seed, max_len = 16, 3, 64
    probe = probe_gradient(model, tokenizer, examples, buckets, seed, max_len, batch_size=2)
    assert probe.dtype == np.float32 and probe.shape == (buckets * model.config.hidden_size,)

    # Reference: one batch of all examples, autograd through a fresh leaf copy of the lm_head weight
    head = model.get_output_embeddings()
    batch = collate([encode(tokenizer, e, max_len) for e in examples], tokenizer.pad_token_id)
    captured = {}
    handle = head.register_forward_hook(lambda m, inputs, out: captured.update(h=inputs[0].detach()))
    with torch.no_grad():
        hf_loss = model(**batch).loss
    handle.remove()
    weight = head.weight.detach().clone().requires_grad_(True)
    logits = captured["h"] @ weight.T
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE
    )
    assert float(loss.detach()) == pytest.approx(float(hf_loss), rel=1e-5)  # the hook sees the real head input
    loss.backward()
    bucket, sign = count_sketch(weight.shape[0], buckets, seed)
    ref = torch.zeros((buckets, weight.shape[1])).index_add_(
        0, torch.from_numpy(bucket), weight.grad * torch.from_numpy(sign)[:, None]
    )
    ref = ref.numpy().ravel()
    assert np.linalg.norm(probe - ref) <= 1e-5 * np.linalg.norm(ref)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_overlap_cosine_undoes_independent_subsampling():
    """Two clients with the SAME gradient and independent 60% masks: plain cosine ~0.6, overlap cosine 1."""
    rng = np.random.default_rng(3)
    g = rng.normal(size=5000)
    masked = np.stack([g * (rng.random(5000) < 0.6) for _ in range(2)])
    assert abs(cosine_relevance(masked, overlap=False)[0, 1] - 0.6) < 0.03
    assert cosine_relevance(masked)[0, 1] > 0.999
    dense = rng.normal(size=(4, 30))
    np.testing.assert_allclose(cosine_relevance(dense), cosine_relevance(dense, overlap=False), atol=1e-12)


def test_without_the_self_term_the_partner_gets_the_mix():
    """Every client's similarity to itself is 1, the top of its row: with it in the softmax a partner gets under half
    of the row at tau 0.3; without it the row is over the others only and the partner leads it."""
    rng = np.random.default_rng(0)
    task_a, task_b = rng.standard_normal(64), rng.standard_normal(64)
    sig = np.stack([task + 0.8 * rng.standard_normal(64) for task in (task_a, task_a, task_b, task_b)])
    with_self = relevance_weights(sig, 0.3)
    without = relevance_weights(sig, 0.3, include_self=False)
    partner = [1, 0, 3, 2]
    assert all(with_self[i, i] > with_self[i, partner[i]] for i in range(4))
    np.testing.assert_array_equal(np.diag(without), np.zeros(4))
    np.testing.assert_allclose(without.sum(axis=1), np.ones(4))
    assert all(without[i, partner[i]] > 0.5 > with_self[i, partner[i]] for i in range(4))
    np.testing.assert_allclose(without[0, 1:], row_softmax(cosine_relevance(sig)[:1, 1:], 0.3)[0])
    np.testing.assert_array_equal(relevance_weights(sig[:1], 0.3, include_self=False), np.ones((1, 1)))
