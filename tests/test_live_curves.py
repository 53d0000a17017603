"""Live curves (``server_app.live``): every round's metrics rows reach TensorBoard event files under the run
directory as they are written, a fresh run starts fresh curves and a resumed one goes on, and a row's non-numbers
never become points."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from server_app.live import scalars
from server_app.rundir import RunDirectory

pytest.importorskip("tensorboardX")


def read_events(directory: Path) -> list[tuple[str, float, int]]:
    """(tag, value, step) of every scalar in the directory's event files (TFRecord framing: length, CRC, data,
    CRC), in file and write order."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            out += [(v.tag, v.simple_value, event.step) for v in event.summary.value]
    return out


def rows(server_round: int, loss: float) -> list[dict]:
    return [
        {"round": server_round, "node": 11, "partition_id": 0, "eval_loss": loss, "train_loss": None, "accepted": True},
        {"round": server_round, "node": 12, "partition_id": 1, "eval_loss": loss + 1, "accepted": False},
        {"round": server_round, "node": None, "eval_loss": loss + 0.5, "seconds": 3.0, "rejected": {"12": "norm"}},
    ]


def test_a_rounds_rows_become_points_and_non_numbers_do_not():
    points = scalars(rows(2, 1.5))
    assert ("client/0/eval_loss", 1.5, 2) in points and ("client/1/update_accepted", 0.0, 2) in points
    assert ("round/eval_loss", 2.0, 2) in points and ("round/replies_refused", 1.0, 2) in points
    assert not any(tag == "client/0/train_loss" for tag, _, _ in points)  # None is no point
    assert not scalars([{"round": 1, "node": 3, "partition_id": 0, "eval_loss": float("nan")}])


def test_curves_are_on_disk_each_round_fresh_for_a_new_run_and_each_round_once_after_a_resume(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.watch(True, fresh=True)
    run.append_metrics(rows(0, 3.0))
    run.append_metrics(rows(1, 2.0))
    seen = [(t, v, s) for t, v, s in read_events(tmp_path / "run" / "tensorboard") if t == "client/0/eval_loss"]
    assert seen == [("client/0/eval_loss", 3.0, 0), ("client/0/eval_loss", 2.0, 1)]  # before the run ends
    run.append_metrics(rows(2, 1.5))  # round 2's rows, then a kill before its checkpoint: resume redoes round 2
    resumed = RunDirectory(tmp_path / "run")
    resumed.truncate_metrics_after(1)
    resumed.watch(True, fresh=False)
    resumed.append_metrics(rows(2, 1.0))
    curve = [(s, v) for t, v, s in read_events(tmp_path / "run" / "tensorboard") if t == "client/0/eval_loss"]
    assert curve == [(0, 3.0), (1, 2.0), (2, 1.0)]  # each round once, the redone round as redone
    again = RunDirectory(tmp_path / "run")
    again.watch(True, fresh=True)  # resume=false: the old curves go with the old metrics
    again.append_metrics(rows(0, 3.5))
    assert [v for t, v, _ in read_events(tmp_path / "run" / "tensorboard") if t == "client/0/eval_loss"] == [3.5]


def test_without_live_curves_nothing_is_written(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.watch(False, fresh=True)
    run.append_metrics(rows(0, 3.0))
    assert not (tmp_path / "run" / "tensorboard").exists() and run.read_metrics()
