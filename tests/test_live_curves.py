"""Live curves (``server_app.live``): every round's metrics rows reach TensorBoard event files under the run
directory as they are written, a fresh run starts fresh curves and a resumed one goes on, a row's non-numbers
never become points, and a strategy's diagnostics and plots reach the board too. Read back with TensorBoard's own
reader (what ``tensorboard --logdir`` shows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_app.live import scalars
from server_app.rundir import RunDirectory

pytest.importorskip("tensorboardX")
pytest.importorskip("tensorboard")


def board(directory: Path):
    """TensorBoard's own reader of the directory's event files, loaded (every event kept)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer(size_guidance={"scalars": 0, "images": 0})
    multiplexer.AddRunsFromDirectory(str(directory))
    multiplexer.Reload()
    return multiplexer


def read_events(directory: Path) -> list[tuple[str, float, int]]:
    """(tag, value, step) of every scalar TensorBoard finds in the directory, by step (several event files, as a
    resumed run leaves, are one run to it)."""
    multiplexer = board(directory)
    out = []
    for run, tags in multiplexer.Runs().items():
        for tag in tags["scalars"]:
            out += [(tag, e.value, e.step) for e in multiplexer.Scalars(run, tag)]
    return sorted(out, key=lambda point: point[2])


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


def test_a_strategys_numbers_become_curves_and_its_ids_and_matrices_do_not():
    row = {
        "round": 3,
        "node": None,
        "vemoe": {"experts": 3, "responsibility": [0.5, 0.25, 0.25], "live": [1, 1, 0], "events": [{"kind": "birth"}]},
        "atlas": {"family-a": {"silhouette": 0.4, "k_scores": {"2": 0.4}, "partitions": [0, 2], "adjacency": [[0.1]]}},
        "rejected": {"12": "norm"},
        "sampled": [11, 12],
    }
    tags = {tag: value for tag, value, _ in scalars([row])}
    assert tags["strategy/vemoe/experts"] == 3 and tags["strategy/vemoe/responsibility/1"] == 0.25
    assert tags["strategy/atlas/family-a/silhouette"] == pytest.approx(0.4)
    assert tags["strategy/atlas/family-a/k_scores/2"] == pytest.approx(0.4)
    assert not [tag for tag in tags if "/live" in tag or "partitions" in tag or "adjacency" in tag]
    assert not [tag for tag in tags if "rejected" in tag or "sampled" in tag]


def plot(path: Path, value: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.imshow([[value, 1 - value]])
    fig.savefig(path)
    plt.close(fig)
    return path


def test_a_rounds_plots_are_images_at_their_round_and_a_resume_puts_the_earlier_ones_back_once(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.watch(True, fresh=True)
    for server_round in (1, 2):
        run.append_metrics(rows(server_round, 2.0))
        drawn = [plot(run.path / "relevance" / f"round-{server_round:03d}.png", 0.3 * server_round)]
        drawn.append(plot(run.path / "clusters" / f"round-{server_round:03d}-family-a.png", 0.2))
        run.live.add_images(server_round, drawn, run.path)
    multiplexer = board(run.path / "tensorboard")
    (name,) = multiplexer.Runs()
    assert sorted(multiplexer.Runs()[name]["images"]) == ["plots/clusters/family-a", "plots/relevance"]
    shown = multiplexer.Images(name, "plots/relevance")
    assert [i.step for i in shown] == [1, 2] and shown[1].width > 0 and shown[1].height > 0
    assert shown[1].encoded_image_string == (run.path / "relevance" / "round-002.png").read_bytes()
    resumed = RunDirectory(tmp_path / "run")
    resumed.watch(True, fresh=False)
    multiplexer = board(run.path / "tensorboard")
    (name,) = multiplexer.Runs()
    assert [i.step for i in multiplexer.Images(name, "plots/relevance")] == [1, 2]
    assert [i.step for i in multiplexer.Images(name, "plots/clusters/family-a")] == [1, 2]
