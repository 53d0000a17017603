"""The member's own privacy ledger (``client_app.member_ledger``) and what a private update keeps on the node: the
ledger survives a restarted SuperNode and a fresh run over the same data, counts a round without noise as such, and
under ``dp.*`` the update is clipped once and nothing measured on it leaves the node (``client_app.handlers``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from client_app import member_ledger
from client_app.handlers import private_update
from common.messages import DpPart, SecAggPart
from common.privacy import epsilon_of
from common.reply_checks import update_norm

PRIVATE = DpPart(clip_norm=1.0, noise_multiplier=2.0, delta=1e-5)
SECURE = SecAggPart(clipping_range=8.0, max_weight=1.0, clip_norm=1.0)


def node(state_dir, run_dir: str = "runs/a", resume: bool = False) -> Context:
    """A fresh SuperNode's context (empty state) for partition 0, keeping its state in ``state_dir``."""
    node_config = {"partition-id": 0, "state-dir": str(state_dir)}
    return Context(1, 7, node_config, RecordDict(), {"run-dir": run_dir, "strategy": "fedavg", "resume": resume})


def test_the_ledger_survives_a_restarted_node_and_a_fresh_run_over_the_same_data(tmp_path):
    assert member_ledger.record(node(tmp_path), 1, PRIVATE)["dp_member_releases"] == 1
    assert member_ledger.record(node(tmp_path), 2, PRIVATE)["dp_member_releases"] == 2  # a restarted SuperNode
    fresh = member_ledger.record(node(tmp_path, run_dir="runs/b"), 1, PRIVATE)  # resume=false, another run-dir
    assert fresh["dp_member_releases"] == 3 and fresh["dp_member_releases_without_noise"] == 0
    assert fresh["dp_member_epsilon"] == pytest.approx(epsilon_of([2.0] * 3, 1e-5))
    path = member_ledger.ledger_path(node(tmp_path))
    assert path is not None and len(path.read_text().splitlines()) == 3
    assert (path.parent.stat().st_mode & 0o777) == 0o700


def test_a_round_without_noise_is_counted_and_no_epsilon_is_claimed_after_it(tmp_path):
    assert member_ledger.record(node(tmp_path), 1, None) == {}  # a plain round: counted, nothing said
    said = member_ledger.record(node(tmp_path), 2, PRIVATE)
    assert said == {"dp_member_releases": 2, "dp_member_releases_without_noise": 1}  # epsilon infinity: not a number
    assert math.isinf(epsilon_of([0.0, 2.0], 1e-5))


def test_a_torn_last_line_is_not_a_release(tmp_path):
    member_ledger.record(node(tmp_path), 1, PRIVATE)
    path = member_ledger.ledger_path(node(tmp_path))
    with open(path, "a") as handle:
        handle.write('{"run": "x", "round": 2, "noise_mult')  # killed while appending: that reply never went out
    assert member_ledger.record(node(tmp_path), 2, PRIVATE)["dp_member_releases"] == 2


def test_without_a_state_dir_the_ledger_lives_in_the_clients_state(monkeypatch):
    monkeypatch.setattr(member_ledger, "state_root", lambda context: None)  # simulation: no state directory
    context = Context(1, 7, {"partition-id": 0}, RecordDict(), {"run-dir": "r", "strategy": "fedavg"})
    member_ledger.record(context, 1, PRIVATE)
    assert member_ledger.record(context, 2, PRIVATE)["dp_member_releases"] == 2


def test_under_dp_an_update_that_cannot_be_counted_is_not_sent(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(OSError, match="privacy ledger"):
        member_ledger.record(node(blocked), 1, PRIVATE)
    assert member_ledger.record(node(blocked), 1, None) == {}  # without dp.*, the round goes on (logged once)


def test_a_private_update_is_clipped_once_to_the_tighter_norm():
    sent = {"w": np.zeros(4, np.float32)}
    updated = {"w": np.array([3.0, 4.0, 0.0, 0.0], np.float32)}  # norm 5
    out = private_update(updated, sent, PRIVATE.model_copy(update={"clip_norm": 2.0}), SECURE, 0)
    assert update_norm(out, sent) == pytest.approx(1.0)
    out = private_update(updated, sent, PRIVATE.model_copy(update={"clip_norm": 0.5}), SECURE, 0)
    assert update_norm(out, sent) == pytest.approx(0.5)
    np.testing.assert_allclose(out["w"] / 0.5, updated["w"] / 5.0, rtol=1e-6)  # scaled, not cut twice
