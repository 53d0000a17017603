"""Differential privacy (``dp.*``): the accountant against the exact Gaussian mechanism, the clipping bound, the noise
the server and the members add, distributed noise through SecAgg+'s quantisation, the stop rule, and every refusal
before round 1 (``common.privacy``, ``server_app.privacy``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.common.secure_aggregation.quantization import quantize
from scipy.optimize import brentq
from scipy.stats import norm

from common.config import ConfigError
from common.messages import read_train
from common.privacy import (
    epsilon_of,
    epsilon_spent,
    fewest_members,
    noise_for_target,
    quantisation_problem,
    share_std,
    with_noise,
)
from common.reply_checks import clip_update, update_norm
from common.secure_bounds import reconstruction_threshold
from server_app import privacy
from strategies import load_run_config
from strategies.base import WEIGHT_EQUALLY, Group, GroupResult


def exact_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """Balle and Wang (ICML 2018), Theorem 8: the exact epsilon of the Gaussian mechanism of sensitivity 1 and
    standard deviation s at delta solves Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s) = delta; ``rounds``
    compositions of noise z are one mechanism of s = z / sqrt(rounds) (their privacy losses add as Gaussians)."""
    s = noise_multiplier / math.sqrt(rounds)

    def excess(eps: float) -> float:
        return norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps + norm.logcdf(-1 / (2 * s) - eps * s)) - delta

    return brentq(excess, 0.0, 500.0)


@pytest.mark.parametrize("z,rounds", [(0.5, 1), (1.0, 4), (2.0, 10), (5.0, 100), (40.0, 100), (0.8, 2)])
def test_the_accountant_bounds_the_exact_gaussian_mechanism_within_ten_percent(z, rounds):
    exact = exact_epsilon(z, rounds, 1e-5)
    ours = epsilon_spent(z, rounds, 1e-5)
    assert exact <= ours <= 1.10 * exact, (exact, ours)


def test_the_libraries_tight_accountant_gives_the_exact_value():
    """dp-accounting's privacy-loss-distribution accountant (the tight one) on the same setting agrees with the
    closed form to 1 %: our reference and the library read the mechanism the same way."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.0), 4)
    assert accountant.get_epsilon(1e-5) == pytest.approx(exact_epsilon(1.0, 4, 1e-5), rel=0.01)


def test_rounds_of_different_noise_compose_and_more_noise_spends_less():
    assert epsilon_of([], 1e-5) == 0.0
    assert epsilon_of([2.0, 2.0, 2.0], 1e-5) == pytest.approx(epsilon_spent(2.0, 3, 1e-5))
    assert epsilon_of([2.0, 4.0], 1e-5) < epsilon_of([2.0, 2.0], 1e-5) < epsilon_of([2.0, 1.0], 1e-5)
    assert epsilon_of([2.0, 0.0], 1e-5) == math.inf


def test_the_calibrated_noise_spends_the_target_and_no_less_would():
    z = noise_for_target(8.0, 1e-5, 4)
    assert epsilon_spent(z, 4, 1e-5) <= 8.0 * (1 + 1e-6)
    assert epsilon_spent(0.99 * z, 4, 1e-5) > 8.0
    with pytest.raises(ValueError, match="no noise multiplier"):
        noise_for_target(1e-9, 1e-5, 1000)


def test_every_members_update_is_clipped_to_the_norm():
    rng = np.random.default_rng(0)
    start = {"a": rng.normal(size=(8, 16)).astype(np.float32), "b": rng.normal(size=(16,)).astype(np.float32)}
    for scale in (1e-3, 0.5, 3.0, 1e3):
        update = {k: v + scale * rng.normal(size=v.shape).astype(np.float32) for k, v in start.items()}
        clipped, was = clip_update(update, start, 1.0)
        assert update_norm(clipped, start) <= 1.0 + 1e-5
        assert was == (update_norm(update, start) > 1.0)
        if not was:
            assert all(np.array_equal(clipped[k], update[k]) for k in update)


def test_central_noise_is_z_c_over_the_members_per_coordinate_of_the_mean():
    cfg = load_run_config({"dp.mode": "central", "dp.noise-multiplier": 2.0, "dp.clip-norm": 0.5})
    mean = {"w": np.zeros(40_000, np.float32)}
    result = GroupResult("g", dict(mean), 4.0, [1, 2, 3, 4])
    privacy.add_central_noise(cfg, [result], np.random.default_rng(1))
    assert result.mean is not None
    assert np.std(result.mean["w"]) == pytest.approx(2.0 * 0.5 / 4, rel=0.02)


def test_each_member_adds_its_share_and_the_fewest_the_sum_can_hold_carry_the_whole_noise():
    cfg = load_run_config(
        {"secure": True, "min-train-replies": 3, "dp.mode": "distributed", "dp.noise-multiplier": 1.5}
    )
    groups = [Group("a", {n: {} for n in range(5)}), Group("b", {n: {} for n in range(10, 13)})]
    privacy.prepare(cfg, groups)
    for group in groups:
        assert group.weight_by == WEIGHT_EQUALLY and group.dp is not None and group.dp.clip_norm == 1.0
        size = len(group.members)
        fewest = fewest_members(size, reconstruction_threshold(size, 1.0, 0.67))  # SecAgg+'s, at the defaults
        assert group.dp.noise_std == pytest.approx(1.5 / math.sqrt(fewest))
        assert fewest * group.dp.noise_std**2 == pytest.approx(1.5**2)  # the whole noise, at the fewest
    draws = with_noise({"w": np.zeros(50_000, np.float32)}, 0.3, np.random.default_rng(2))["w"]
    assert np.std(draws) == pytest.approx(0.3, rel=0.02)


@pytest.mark.parametrize("survivors", [3, 5])
def test_distributed_noise_survives_secaggs_quantisation(survivors):
    """Members' shares (sized for 3 survivors of 5) quantised by Flower's own SecAgg+ quantiser (clamp to the
    clipping range, stochastic rounding to the grid), summed as integers and read back: the unmasked sum's noise
    variance, measured over 40,000 coordinates, is at least the target's (z C)^2 (less 4 standard errors of the
    estimate) whoever survives."""
    z, clip_norm, clipping_range, levels = 1.0, 1.0, 8.0, 2**22
    share = share_std(z, clip_norm, 3)
    assert quantisation_problem(share, clip_norm, clipping_range, levels) is None
    rng = np.random.default_rng(3)
    n = 40_000
    updates = [rng.uniform(-0.005, 0.005, n) for _ in range(survivors)]  # within the clip norm, coordinate-wise
    quantised = sum(
        quantize([u + rng.normal(0, share, n)], clipping_range, levels)[0].astype(np.int64) for u in updates
    )
    summed = quantised * (2 * clipping_range / levels) - survivors * clipping_range  # SecAgg+'s dequantisation
    noise = summed - sum(updates)
    target = (z * clip_norm) ** 2
    assert np.var(noise) >= target * (1 - 4 * math.sqrt(2 / n)), (np.var(noise), target)
    assert abs(np.mean(noise)) < 4 * math.sqrt(survivors) * share / math.sqrt(n)  # unbiased


def test_a_round_whose_group_share_is_finer_than_secaggs_grid_is_refused_before_it_trains():
    cfg = load_run_config(
        {
            "secure": True,
            "min-train-replies": 3,
            "dp.mode": "distributed",
            "dp.noise-multiplier": 1.0,
            "dp.clip-norm": 0.01,
        }
    )  # fine for 3 shares (0.0058 against a step of 3.8e-6), too fine for the threshold of 100 members
    privacy.prepare(cfg, [Group("small", {n: {} for n in range(3)})])
    with pytest.raises(ValueError, match="secagg.quantization-range"):
        privacy.prepare(cfg, [Group("large", {n: {} for n in range(100)})])


def test_a_quantisation_that_would_change_the_noise_is_refused():
    assert "quantization-range" in quantisation_problem(1e-6, 1.0, 8.0, 2**22)
    assert "clipping-range" in quantisation_problem(2.0, 1.0, 8.0, 2**22)


def test_a_run_stops_before_the_round_that_would_pass_its_target():
    cfg = load_run_config({"num-server-rounds": 4, "dp.mode": "central", "dp.target-epsilon": 8.0})
    z = privacy.noise_multiplier(cfg)
    assert all(privacy.stop_reason(cfg, [z] * (r - 1), r) is None for r in range(1, 5))
    assert "round 5 would spend" in (privacy.stop_reason(cfg, [z] * 4, 5) or "")
    # a given noise multiplier that the target cannot carry through every round: the run stops where it would
    given = load_run_config(
        {"num-server-rounds": 4, "dp.mode": "central", "dp.target-epsilon": 8.0, "dp.noise-multiplier": 1.0}
    )
    first_over = next(r for r in range(1, 5) if epsilon_spent(1.0, r, 1e-5) > 8.0)
    assert privacy.stop_reason(given, [1.0] * (first_over - 1), first_over) is not None
    assert privacy.round_row(given, [1.0, 1.0])["dp_epsilon"] == pytest.approx(epsilon_spent(1.0, 2, 1e-5))


@pytest.mark.parametrize(
    "flat,key,reason",
    [
        ({"dp.mode": "distributed", "dp.target-epsilon": 8.0}, "dp.mode", "needs secure=true"),
        (
            {"dp.mode": "central", "dp.target-epsilon": 8.0, "secure": True, "min-train-replies": 3},
            "dp.mode",
            "the members add it",
        ),
        ({"dp.mode": "central"}, "dp.target-epsilon", "set it"),
        ({"dp.mode": "central", "dp.target-epsilon": 1e-9, "num-server-rounds": 1000}, "dp.target-epsilon", "no noise"),
        ({"dp.mode": "central", "dp.target-epsilon": 8.0, "dp.delta": 0}, "dp.delta", "greater than 0"),
        (
            {
                "dp.mode": "distributed",
                "dp.noise-multiplier": 2.0,
                "dp.clip-norm": 2.0,
                "secure": True,
                "min-train-replies": 3,
            },
            "secagg.clipping-range",
            "would clamp a member's noise",
        ),
        ({"dp.mode": "central", "dp.target-epsilon": 8.0, "strategy": "atlas"}, "dp.mode", "fingerprint"),
        ({"dp.mode": "central", "dp.target-epsilon": 8.0, "strategy": "mira"}, "dp.mode", "fingerprint"),
        ({"dp.mode": "central", "dp.target-epsilon": 8.0, "strategy": "simgrad"}, "dp.mode", "gradient signature"),
        ({"dp.mode": "central", "dp.target-epsilon": 8.0, "strategy": "vemoe"}, "dp.mode", "birth votes"),
        ({"dp.mode": "central", "dp.target-epsilon": 8.0, "strategy": "local"}, "dp.mode", "nothing to privatise"),
    ],
)
def test_a_private_run_that_cannot_be_accounted_is_refused_before_round_one_naming_the_key(flat, key, reason):
    with pytest.raises(ConfigError) as err:
        load_run_config(flat)
    assert f"{key}: " in str(err.value) and reason in str(err.value), str(err.value)


@pytest.mark.parametrize("strategy", ["fedavg", "fedavg-dual", "fedsa-lora"])
def test_strategies_that_release_only_their_sums_run_privately(strategy):
    cfg = load_run_config({"strategy": strategy, "dp.mode": "central", "dp.target-epsilon": 8.0})
    assert cfg.dp.enabled and privacy.noise_multiplier(cfg) > 0


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("z", [1e-9, 4.0])
def test_a_central_round_weighs_members_equally_clips_them_and_noises_only_the_mean(z, monkeypatch):
    """A plain FedAvg round through the real transport (an in-memory grid answers for 3 members) under
    dp.mode='central': each member is told the clip norm, a member claiming 40 examples counts as one, the server
    clips what it receives, and the mean is the clipped members' plain mean plus N(0, (z C / 3)^2) per coordinate."""
    import test_transport_plain
    from test_transport_plain import METRICS, START, InMemoryGrid

    from common.records import train_reply
    from server_app.offenders import Offenders
    from server_app.training import reply_limits, train_round
    from strategies.base import ClientInfo
    from strategies.fedavg import FedAvg

    clip_norm = 0.5
    cfg = load_run_config({"dp.mode": "central", "dp.noise-multiplier": z, "dp.clip-norm": clip_norm})
    start = {k: np.zeros((60, 40), np.float32) for k in START}  # 4,800 coordinates: enough to measure the noise
    monkeypatch.setattr(test_transport_plain, "START", start)  # the shapes the in-memory grid reads instructions by
    rng = np.random.default_rng(4)
    updates = {
        nid: {k: (s * rng.normal(size=v.shape)).astype(np.float32) for k, v in start.items()}
        for nid, s in ((1, 1e-4), (2, 0.05), (3, 1.0))
    }  # norms ~0.01, ~3.5, ~70: two beyond C
    claims = {1: 1, 2: 1, 3: 40}  # member 3 claims more weight than DP's equal weighting allows
    grid = InMemoryGrid({nid: (lambda a, nid=nid: train_reply(updates[nid], claims[nid], METRICS)) for nid in updates})
    strategy = FedAvg()
    strategy.initialise({nid: ClientInfo(nid, nid, "m", start) for nid in updates})
    limits = reply_limits(cfg)
    _, (result,) = train_round(grid, None, cfg, strategy, 1, [1, 2, 3], Offenders(0, 0), limits)
    assert all(read_train(m.content["fitins.config"], None).dp.clip_norm == clip_norm for m in grid.sent)
    clipped = [clip_update(updates[n], start, clip_norm)[0] for n in (1, 2, 3)]
    plain_mean = {k: sum(c[k] for c in clipped) / 3 for k in start}
    noise = np.concatenate([(result.mean[k] - plain_mean[k]).ravel() for k in start])
    if z < 1e-6:
        assert np.abs(noise).max() < 1e-6  # equal weights, clipped: the plain mean itself
    else:
        assert np.std(noise) == pytest.approx(z * clip_norm / 3, rel=0.05)


@pytest.mark.usefixtures("task_identity")
def test_a_central_round_clips_before_any_norm_check_and_keeps_no_measured_norm(monkeypatch):
    """Under dp.*, an update far beyond robust.max-update-norm is clipped and counted, never refused for its norm (the
    count a mean divides by must not depend on the data), and no member's norm or clip note reaches its row."""
    import test_transport_plain
    from test_transport_plain import METRICS, START, InMemoryGrid

    from common.records import train_reply
    from server_app.offenders import Offenders
    from server_app.training import reply_limits, train_round, train_rows
    from strategies.base import ClientInfo
    from strategies.fedavg import FedAvg

    cfg = load_run_config({"dp.mode": "central", "dp.noise-multiplier": 1e-9, "dp.clip-norm": 0.5})
    start = {k: np.zeros((6, 4), np.float32) for k in START}
    monkeypatch.setattr(test_transport_plain, "START", start)
    rng = np.random.default_rng(5)
    updates = {
        n: {k: (s * rng.normal(size=v.shape)).astype(np.float32) for k, v in start.items()}
        for n, s in ((1, 1e-3), (2, 1.0), (3, 100.0))
    }  # norms ~0.005, ~5, ~500
    grid = InMemoryGrid(
        {n: (lambda a, n=n: train_reply(updates[n], 1, {**METRICS, "update_norm": 9.0})) for n in updates}
    )
    strategy = FedAvg()
    strategy.initialise({n: ClientInfo(n, n, "m", start) for n in updates})
    limits = reply_limits(cfg, max_update_norm=1.0)  # the norm bound a plain round would refuse members 2 and 3 by
    parts, (result,) = train_round(grid, None, cfg, strategy, 1, [1, 2, 3], Offenders(0, 0), limits)
    assert sorted(result.contributors) == [1, 2, 3] and not result.rejected
    clipped = [clip_update(updates[n], start, 0.5)[0] for n in (1, 2, 3)]
    for k in start:
        np.testing.assert_allclose(result.mean[k], sum(c[k] for c in clipped) / 3, atol=1e-6)
    rows = train_rows(parts, 0.0, {})
    assert all(rows[n]["update_norm"] is None and "robust" not in rows[n] for n in (1, 2, 3)), rows
    assert "update_norm_median" not in rows[None]
