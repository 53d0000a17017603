"""Finding who is behind refused secure aggregates (``server_app.offenders``): a group holding suspects is split
into subgroups of at least 3 with the suspects spread over them, the subgroups' means combine into the group's, and
a member refused in ``exclude-after`` rounds in a row is excluded while the honest members train on."""

from __future__ import annotations

import numpy as np
import pytest

from server_app.offenders import Offenders, combine
from strategies.base import MIN_SECURE_GROUP, Group, GroupResult


def group(name: str, members) -> Group:
    return Group(name, {n: {"w": np.zeros(2, np.float32)} for n in members})


def run_round(offenders: Offenders, server_round: int, groups: list[Group], hostile: set[int]) -> list[GroupResult]:
    """One secure round in which a (sub)group's aggregate is refused exactly when it holds a hostile member."""
    parts = offenders.split(server_round, groups)
    results = []
    for part in parts:
        bad = hostile & set(part.members)
        mean = None if bad else {"w": np.full(2, float(len(part.members)), np.float32)}
        results.append(
            GroupResult(
                part.name, mean, float(len(part.members)), part.members, aggregate_rejected="box" if bad else None
            )
        )
    offenders.observe(server_round, results)
    return results


def test_one_hostile_member_among_nine_is_found_and_excluded_while_the_others_train():
    offenders = Offenders(exclude_after=3, seed=0)
    members, hostile = list(range(1, 10)), {7}
    trained = []
    for server_round in range(1, 7):
        live = [n for n in members if n not in offenders.excluded]
        results = run_round(offenders, server_round, [group("pool", live)], hostile)
        assert all(len(r.contributors) >= MIN_SECURE_GROUP for r in results)  # never a smaller secure group
        trained.append(sorted(n for r in results if r.mean is not None for n in r.contributors))
    assert list(offenders.excluded) == [7] and "3 rounds in a row" in offenders.excluded[7]
    assert trained[0] == []  # round 1: the one group refused
    assert len(trained[1]) == 6  # round 2: three subgroups of three, the hostile one's refused
    assert trained[3] == [n for n in members if n != 7]  # once it is out, everyone else trains together
    assert set(offenders.strikes) == {7}  # nobody else carries a strike


def test_a_split_groups_mean_is_the_weighted_mean_over_the_members_of_its_accepted_subgroups():
    planned = [group("g", range(1, 10)), group("other", [20, 21, 22])]
    offenders = Offenders(seed=1)
    offenders.strikes = {1: 1, 2: 1, 3: 1}
    parts = offenders.split(2, planned)
    assert sorted(p.name for p in parts) == ["g/part-1", "g/part-2", "g/part-3", "other"]
    assert all(len({1, 2, 3} & set(p.members)) == 1 for p in parts if p.name.startswith("g/"))  # suspects spread
    rng = np.random.default_rng(0)
    update = {n: rng.normal(size=2) for n in range(1, 10)}
    weight = {n: float(n) for n in range(1, 10)}
    results = []
    for part in parts:
        if part.name == "other":
            results.append(GroupResult("other", {"w": np.ones(2, np.float32)}, 3.0, part.members))
            continue
        refused = 1 in part.members
        total = sum(weight[n] for n in part.members)
        mean = {"w": sum(weight[n] * update[n] for n in part.members) / total}
        results.append(
            GroupResult(
                part.name, None if refused else mean, total, part.members, aggregate_rejected="x" if refused else None
            )
        )
    g, other = combine(planned, results)
    kept = [n for p in parts if p.name.startswith("g/") and 1 not in p.members for n in p.members]
    expected = sum(weight[n] * update[n] for n in kept) / sum(weight[n] for n in kept)
    np.testing.assert_allclose(g.mean["w"], expected, rtol=1e-6)
    assert sorted(g.contributors) == sorted(kept) and g.aggregate_rejected is None and other.name == "other"


@pytest.mark.parametrize("size", [3, 4, 5])
def test_a_group_too_small_to_split_into_groups_of_three_stays_whole(size):
    offenders = Offenders()
    offenders.strikes = {1: 1, 2: 1}
    (kept,) = offenders.split(1, [group("g", range(1, size + 1))])
    assert kept.name == "g" and kept.members == list(range(1, size + 1))


def test_an_accepted_round_clears_a_members_strikes_and_exclude_after_0_never_excludes():
    offenders = Offenders(exclude_after=0)
    for server_round in range(1, 6):
        run_round(offenders, server_round, [group("g", [1, 2, 3])], {3})
    assert not offenders.excluded and offenders.strikes[1] == 5
    run_round(offenders, 6, [group("g", [1, 2, 4])], set())
    assert 1 not in offenders.strikes and 2 not in offenders.strikes


def test_each_subgroup_of_a_split_group_gets_its_own_config_and_its_own_dp_noise_share():
    """Subgroups of one secure group are sized apart, so distributed DP sizes each one's noise share for its own
    members: a config shared between them would give every subgroup the last one's share."""
    from common.privacy import fewest_members, share_std
    from common.secure_bounds import reconstruction_threshold
    from server_app import privacy
    from strategies import load_run_config
    from strategies.simgrad.wire import SimGradWire

    cfg = load_run_config(
        {
            "secure": True,
            "min-train-replies": 3,
            "dp.mode": "distributed",
            "dp.noise-multiplier": 1.0,
            "dp.clip-norm": 0.1,
            "secagg.num-shares": 1.0,
            "secagg.reconstruction-threshold": 1.0,
        }
    )
    offenders = Offenders(exclude_after=3, seed=0)
    offenders.strikes.update({1: 1, 2: 1})
    whole = group("pool", range(1, 10))
    whole.config = SimGradWire(active_blocks=(1,))
    parts = offenders.split(1, [whole])
    assert sorted(len(p.members) for p in parts) == [4, 5]
    privacy.prepare(cfg, parts)
    for part in parts:
        size = len(part.members)
        threshold = reconstruction_threshold(size, cfg.secagg.num_shares, cfg.secagg.reconstruction_threshold)
        assert part.dp is not None and part.dp.noise_std == share_std(1.0, 0.1, fewest_members(size, threshold))
        assert part.config == whole.config  # the strategy's part, shared
    assert parts[0].dp != parts[1].dp
    assert whole.dp is None  # the planned group is left as the strategy made it
