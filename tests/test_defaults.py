"""Choosing a default on several structures (``bench.defaults``): a value is judged by the harm it does on the preset
where it does the most, then by the mean client; a value not checked on every preset is never chosen."""

from __future__ import annotations

import pytest

from bench.defaults import Against, against_local, candidate_label, choose_default, markdown


def rows(label: str, seed: int, losses: list[float], last: int = 4) -> list[dict]:
    return [
        {"strategy": label, "seed": seed, "client": c, "round": r, "eval_loss": loss if r == last else 9.0}
        for c, loss in enumerate(losses)
        for r in (0, last)
    ]


def test_against_local_differences_the_worst_and_mean_client_seed_by_seed():
    data = rows("local", 0, [1.0, 2.0, 3.0]) + rows("x", 0, [0.8, 2.2, 2.9])
    data += rows("local", 1, [1.0, 2.0, 3.0]) + rows("x", 1, [1.0, 2.0, 3.2])
    record = against_local(data, "x")
    assert record is not None and record.seeds == 2 and record.clients_worse == 1.0
    assert record.worst == pytest.approx((-0.1 + 0.2) / 2)  # 2.9 - 3.0 on seed 0, 3.2 - 3.0 on seed 1
    assert record.mean == pytest.approx((-0.1 / 3 + 0.2 / 3) / 2)
    assert against_local(rows("local", 0, [1.0]), "x") is None


def table(**by_value: tuple[float, float]) -> dict[str, dict[str, Against | None]]:
    """value -> (worst on preset p, worst on preset q); mean = worst / 2."""
    return {
        v: {p: Against(w, w / 2, 0, 1) for p, w in zip(("pairs", "partnerless"), worsts)}
        for v, worsts in by_value.items()
    }


def test_the_value_that_harms_no_structure_most_wins_over_one_that_is_best_where_it_was_tuned():
    # "2" is best on pairs (-0.05) but costs the partner-less clients (+0.2); "1" is a little worse on pairs
    chosen, reason = choose_default(table(**{"1": (-0.03, -0.01), "2": (-0.05, 0.2)}))
    assert chosen == "1" and "-0.010" in reason


def test_within_the_tie_the_lower_mean_client_wins_and_an_unchecked_value_never_does():
    t = table(**{"1": (-0.03, 0.001), "2": (-0.03, 0.0)})
    t["1"]["pairs"] = Against(-0.03, -0.2, 0, 1)  # a much better mean client, harm within TIE of "2"'s
    assert choose_default(t)[0] == "1"
    t["3"] = {"pairs": Against(-0.5, -0.5, 0, 1), "partnerless": None}  # never ran on the partner-less preset
    assert choose_default(t)[0] == "1"
    with pytest.raises(ValueError, match="no value ran on every preset"):
        choose_default({"3": t["3"]})


def test_the_report_names_every_cell_and_the_choice():
    t = table(**{"1": (-0.03, -0.01), "2": (-0.05, 0.2)})
    text = markdown("atlas.min-cluster-size", "atlas", t, *choose_default(t))
    assert "| 2 | -0.050 / -0.025 / 0 | +0.200 / +0.100 / 0 |" in text
    assert "Chosen: **atlas.min-cluster-size=1**" in text


def test_a_candidate_is_a_key_value_or_a_whole_set_of_overrides_and_defaults_is_the_strategy_alone():
    assert candidate_label("atlas", "", "atlas.min-cluster-size", "2") == "atlas:atlas.min-cluster-size=2"
    assert candidate_label("vemoe", "x=1", "y", "2") == "vemoe:x=1 y=2"
    assert candidate_label("vemoe", "", None, "defaults") == "vemoe"
    both = "vemoe.personal-lora=true vemoe.likelihood='summed'"
    assert candidate_label("vemoe", "", None, both) == f"vemoe:{both}"
    t = table(**{"defaults": (0.2, 0.1), both: (-0.03, -0.01)})
    assert f"Chosen: **{both}**" in markdown(None, "vemoe", t, *choose_default(t))
