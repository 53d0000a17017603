"""The server's write-ahead privacy ledger (``server_app.ledger``) and the resume rules around it: a round is counted
before any member is asked to train, a round redone after a crash is counted again, rounds a checkpoint holds without
noise are counted as such (epsilon infinity), and a resume with other ``dp.*`` settings is refused naming the key."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from common.privacy import epsilon_of
from server_app import app as server_app
from server_app.admission import Admission
from server_app.ledger import LedgerError, PrivacyLedger
from server_app.offenders import Offenders
from server_app.rundir import RunDirectory
from strategies import load_run_config
from strategies.base import ClientInfo
from strategies.fedavg import FedAvg

PRIVATE = {"dp.mode": "central", "dp.target-epsilon": 8.0, "num-server-rounds": 3}


def _adapter() -> dict[str, np.ndarray]:
    return {"a": np.zeros((2, 3), np.float32), "b": np.zeros((3, 2), np.float32)}


def _federation(tmp_path, flat: dict, ledger_run: str | None = None) -> server_app.Federation:
    cfg = load_run_config({**flat, "run-dir": str(tmp_path / "run")})
    strategy = FedAvg()
    clients = {n: ClientInfo(n, n, "smol", _adapter()) for n in (1, 2, 3)}
    strategy.initialise(clients)
    run = RunDirectory(cfg.run_dir)
    ledger = PrivacyLedger(run.path, ledger_run)
    return server_app.Federation(cfg, run, strategy, [1, 2, 3], clients, set(), Admission(), Offenders(0, 0), ledger)


class _Grid:
    def get_node_ids(self):
        return [1, 2, 3]


class _Killed(Exception):
    """The server dies while the round's instructions are out (a SIGKILL, as far as the ledger can tell)."""


def test_a_round_is_on_the_ledger_before_its_first_train_instruction_and_a_redone_round_counts_twice(
    tmp_path, monkeypatch
):
    fed = _federation(tmp_path, PRIVATE)
    z = server_app.privacy.noise_multiplier(fed.cfg)
    seen: list[list[float]] = []

    def killed_while_training(*args, **kwargs):
        seen.append(PrivacyLedger(fed.run.path, fed.ledger.run).noise_multipliers())  # read back from the disk
        raise _Killed

    monkeypatch.setattr(server_app, "train_round", killed_while_training)
    server_app._checkpoint(fed.run, 0, fed.strategy, server_app._checkpoint_meta(fed.cfg, [1, 2, 3], None, fed.ledger))
    with pytest.raises(_Killed):
        server_app.run_round(_Grid(), None, fed, 1)
    assert seen == [[z]]  # durably recorded before the instructions went out
    # the restarted server resumes from the round-0 checkpoint and redoes round 1: two releases, two lines
    meta, state = fed.run.load_checkpoint()
    resumed = _federation(tmp_path, {**PRIVATE, "resume": True}, meta["ledger-run"])
    assert server_app.resume_federation(resumed, (meta, state)) == 1
    assert resumed.dp_noise == [z]  # the lost round is still counted
    with pytest.raises(_Killed):
        server_app.run_round(_Grid(), None, resumed, 1)
    assert seen[-1] == [z, z]
    assert server_app.privacy.round_row(resumed.cfg, resumed.dp_noise)["dp_epsilon"] == pytest.approx(
        epsilon_of([z, z], 1e-5)
    )
    # and the redone round takes the run past its target sooner: round 3 would be a fourth release
    assert server_app.privacy.stop_reason(resumed.cfg, [z, z, z], 3) is not None


def test_a_fresh_run_in_the_same_directory_keeps_the_earlier_lines(tmp_path):
    first = PrivacyLedger(tmp_path)
    first.record(1, 2.0, mode="central")
    second = PrivacyLedger(tmp_path)  # resume=false: a run of its own, below the first's lines
    second.record(1, 3.0, mode="central")
    lines = [json.loads(line) for line in (tmp_path / "privacy-ledger.jsonl").read_text().splitlines()]
    assert [(line["run"], line["noise_multiplier"]) for line in lines] == [(first.run, 2.0), (second.run, 3.0)]
    assert first.noise_multipliers() == [2.0] and second.noise_multipliers() == [3.0]


def test_rounds_a_checkpoint_holds_without_a_ledger_count_as_released_without_noise(tmp_path):
    """A checkpoint of 3 rounds from before the ledger: without its settings it is refused under dp.*; with this
    run's settings but no noise list, its 3 rounds go on the ledger without noise (epsilon infinity), never as
    nothing."""
    fed = _federation(tmp_path, PRIVATE)
    meta = {"strategy": "fedavg", "round": 3, "nodes": [1, 2, 3], "arrays": "state-00003.npz"}
    with pytest.raises(ValueError, match="dp.mode: 'unrecorded' -> 'central'"):
        server_app.resume_federation(fed, (meta, fed.strategy.state_dict()))
    assert not fed.ledger.path.exists()
    server_app.resume_federation(fed, ({**meta, "settings": fed.cfg.to_flat()}, fed.strategy.state_dict()))
    assert fed.dp_noise == [0.0, 0.0, 0.0]
    assert math.isinf(server_app.privacy.round_row(fed.cfg, [*fed.dp_noise, 1.0])["dp_epsilon"])
    assert server_app.privacy.stop_reason(fed.cfg, fed.dp_noise, 4) is not None  # and a target stops the run


def test_a_checkpoints_noise_list_that_names_every_round_fills_the_ledger(tmp_path):
    ledger = PrivacyLedger(tmp_path)
    ledger.unrecorded(2, [1.5, 1.5])
    assert ledger.noise_multipliers() == [1.5, 1.5]
    ledger.unrecorded(2, [1.5, 1.5])  # already held: nothing added
    assert ledger.noise_multipliers() == [1.5, 1.5]
    short = PrivacyLedger(tmp_path / "x")
    (tmp_path / "x").mkdir()
    short.unrecorded(3, [1.5])  # a list that misses rounds (written only when dp was on): no noise for all three
    assert short.noise_multipliers() == [0.0, 0.0, 0.0]


def test_resuming_under_other_privacy_settings_is_refused_naming_the_key(tmp_path):
    plain = load_run_config({"num-server-rounds": 3})
    saved = FedAvg()
    saved.initialise({1: ClientInfo(1, 0, "smol", _adapter())})
    meta = {"strategy": "fedavg", "round": 3, **server_app._checkpoint_meta(plain, [1])}
    with pytest.raises(ValueError, match=r"dp.mode: 'off' -> 'central'.*dp.target-epsilon: 0.0 -> 8.0"):
        server_app.check_resumable(load_run_config(PRIVATE), saved, meta, saved.state_dict(), "ckpt")
    private = {"strategy": "fedavg", "round": 1, **server_app._checkpoint_meta(load_run_config(PRIVATE), [1])}
    with pytest.raises(ValueError, match=r"dp.target-epsilon: 8.0 -> 4.0"):
        server_app.check_resumable(
            load_run_config({**PRIVATE, "dp.target-epsilon": 4.0}), saved, private, saved.state_dict(), "ckpt"
        )
    server_app.check_resumable(load_run_config(PRIVATE), saved, private, saved.state_dict(), "ckpt")  # same: fine


def test_a_release_that_cannot_be_recorded_does_not_go_out(tmp_path):
    directory = tmp_path / "gone"
    ledger = PrivacyLedger(directory)  # its directory does not exist: the append fails as a full disk would
    with pytest.raises(LedgerError, match="round 2 not started"):
        ledger.record(2, 1.0)
