"""Run plots group a client's rows by partition, so a resumed simulation (new node ids) keeps one line per client;
what members report (task sets, model names) is drawn as written, and a figure that cannot be drawn is logged and
never stops a run."""

from __future__ import annotations

import logging

import pytest

from common import plots
from common.plots import client_key, client_keys, client_label, eval_loss

# Math text a member may report as its tasks: matplotlib parsed "$...$" and raised (an unknown symbol, a bare "^")
HOSTILE_TEXTS = ["$\\foo$", "$^$", "a $\\frac{1}{0} \\undefined$ b"]


def resumed_rows() -> list[dict]:
    rows = []
    for server_round, nodes in ((0, (11, 12, 13)), (1, (11, 12, 13)), (2, (21, 22, 23))):  # resumed before round 2
        for partition, node in enumerate(nodes):
            rows.append(
                {
                    "round": server_round,
                    "node": node,
                    "partition_id": partition,
                    "tasks": f"t{partition}",
                    "eval_loss": 3.0 - server_round - partition / 10,
                }
            )
        rows.append({"round": server_round, "node": None, "eval_loss": 2.9 - server_round})
    return rows


def test_a_resumed_run_keeps_one_line_per_partition(tmp_path):
    rows = resumed_rows()
    assert {client_key(r) for r in rows} == {0, 1, 2, None} and client_keys(rows) == [0, 1, 2]
    assert client_label(rows, 1) == "1 (t1)"
    assert client_key({"node": 7}) == 7  # rows without a partition (older runs) fall back to the node
    assert eval_loss(rows, tmp_path / "eval_loss.png").stat().st_size > 1000


def _hostile_rows(text: str) -> list[dict]:
    rows = resumed_rows()
    for row in rows:
        if row.get("partition_id") == 1:
            row["tasks"] = text
    return rows


def _atlas_family(text: str) -> dict:
    """An ATLAS/MIRA family row of 4 clients clustered in round 1, client 0's reported tasks ``text``."""
    return {
        "points": [[-1.0, 0.5], [1.0, 0.1], [-1.1, -0.4], [1.2, -0.2]],
        "clusters": [0, 1, 0, 1],
        "clustered_round": 1,
        "k": 2,
        "purity": 1.0,
        "explained_variance": 0.9,
        "partitions": [0, 1, 2, 3],
        "tasks": [text, "t1", "t0", "t1"],
        "adjacency_raw": [[1.0, 0.2, 0.9, 0.1], [0.2, 1.0, 0.1, 0.8], [0.9, 0.1, 1.0, 0.2], [0.1, 0.8, 0.2, 1.0]],
        "adjacency": [[0.4, 0.1, 0.4, 0.1], [0.1, 0.5, 0.0, 0.4], [0.4, 0.0, 0.5, 0.1], [0.0, 0.4, 0.1, 0.5]],
        "alpha": 1.0,
    }


@pytest.mark.parametrize("text", HOSTILE_TEXTS)
def test_math_text_a_member_reports_is_drawn_as_written_in_every_figure(tmp_path, text):
    """A ``tasks`` (or model name) of ``$\\foo$`` raised ``ValueError: Unknown symbol`` in every figure that labels
    a client with it, and the ServerApp with it: each figure is now written, the text drawn as plain text."""
    from strategies.atlas import plots as atlas_plots
    from strategies.fingerprint import plots as fingerprint_plots
    from strategies.simgrad import plots as simgrad_plots

    rows = _hostile_rows(text)
    assert client_label(rows, 1) == f"1 ({text})"
    drawn = [
        eval_loss(rows, tmp_path / "eval_loss.png"),
        plots.worst_client(rows, tmp_path / "worst_client.png"),
        plots.negative_transfer(rows, resumed_rows(), tmp_path / "negative_transfer.png"),
        *atlas_plots.fingerprints(1, {text: _atlas_family(text)}, tmp_path / "clusters"),
        *fingerprint_plots.adjacency(1, {"small": _atlas_family(text)}, tmp_path / "adjacency"),
        *fingerprint_plots.adjacency(
            1, atlas_plots.by_cluster({"small": _atlas_family(text)}), tmp_path / "by-cluster"
        ),
        simgrad_plots.relevance(
            1,
            {
                "relevance_partitions": [0, 1],
                "relevance_models": [text, "small"],
                "relevance": [[1.0, 0.5], [0.5, 1.0]],
                "relevance_weights": [[0.6, 0.4], [0.4, 0.6]],
            },
            tmp_path / "relevance.png",
        ),
        simgrad_plots.gates([{**r, "beta": [0.5, 0.4]} for r in rows], tmp_path / "gates.png"),
    ]
    rows_with_groups = [
        {"round": 1, "node": None, "atlas": {text: {"partitions": [0, 1, 2], "groups": [0, 1, 0]}}},
        *[r for r in rows if r["node"] is not None],
    ]
    drawn.append(atlas_plots.cluster_loss(rows_with_groups, tmp_path / "cluster-loss.png"))
    assert len(drawn) == 9 and all(path.stat().st_size > 1000 for path in drawn), drawn


def test_the_atlas_strategy_draws_a_round_whose_member_reported_math_text(tmp_path):
    """ATLAS's ``plot_round`` on a clustering round where client 0 reported ``$\\foo$`` as its tasks: its figure is
    written (before: the round's plot raised, which stopped the run)."""
    from test_atlas_strategy import clients, report

    from strategies.atlas import Atlas, AtlasSection
    from strategies.fingerprint import FingerprintSection

    strategy = Atlas(AtlasSection(k=2), FingerprintSection())
    strategy.initialise(clients(4))
    reports = {100 + i: report(i, i % 2) for i in range(4)}
    reports[100].tasks = "$\\foo$"
    strategy.observe_reports(1, reports)
    row = {"atlas": strategy.report()["atlas"]}
    assert row["atlas"]["small"]["tasks"][0] == "$\\foo$"
    drawn = strategy.plot_round(1, row, tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in drawn] == ["clusters/round-001-small.png"]
    assert drawn[0].stat().st_size > 5_000


@pytest.fixture
def plot_log(caplog):
    """The records of the figures' logger (``tessera.plots``, which does not propagate)."""
    logger = logging.getLogger("tessera.plots")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def test_a_figure_that_raises_is_logged_by_name_returns_nothing_and_leaves_no_figure_open(plot_log):
    plt = plots.pyplot()
    before = set(plt.get_fignums())

    def broken():
        plt.subplots()
        raise ValueError("Unknown symbol: \\foo")

    assert plots.drawn("round-001-small.png", broken, None) is None
    assert plots.drawn("gates", broken, []) == []
    assert set(plt.get_fignums()) == before  # the figures it opened are closed
    errors = [r.getMessage() for r in plot_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "round-001-small.png" in errors[0] and "Unknown symbol" in errors[0], errors
    assert plots.drawn("fine", lambda: 3, None) == 3


def test_a_strategys_plot_that_raises_is_logged_and_draws_nothing(tmp_path, monkeypatch, plot_log):
    """Every strategy's own ``plot_round`` / ``plot_run`` (ATLAS's here, and one defined by a new subclass) is
    wrapped where the class is made: whatever it raises is logged naming the strategy and the figures, and it
    returns no path, wherever the ServerApp calls it."""
    from test_atlas_strategy import atlas

    from strategies.atlas import Atlas, AtlasSection
    from strategies.atlas import plots as atlas_plots
    from strategies.fingerprint import FingerprintSection

    def unknown_symbol(*args, **kwargs):
        raise ValueError("Unknown symbol: \\foo")

    strategy = atlas([0, 1, 0, 1])
    monkeypatch.setattr(atlas_plots, "fingerprints", unknown_symbol)
    monkeypatch.setattr(atlas_plots, "cluster_loss", unknown_symbol)
    assert strategy.plot_round(1, {"atlas": strategy.report()["atlas"]}, tmp_path) == []
    assert strategy.plot_run([], tmp_path) == []

    class Broken(Atlas):
        name = "broken-atlas"

        def plot_run(self, rows, run_dir):
            raise RuntimeError("disk full")

    assert Broken(AtlasSection(), FingerprintSection()).plot_run([], tmp_path) == []
    errors = [r.getMessage() for r in plot_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, errors
    assert "atlas plot_round" in errors[0] and "Unknown symbol" in errors[0]
    assert "atlas plot_run" in errors[1] and "broken-atlas plot_run" in errors[2] and "disk full" in errors[2]


def test_the_run_dirs_eval_loss_plot_that_raises_is_logged_and_gives_no_path(tmp_path, monkeypatch, plot_log):
    from server_app.rundir import RunDirectory

    run = RunDirectory(tmp_path / "run")
    run.append_metrics(resumed_rows())
    assert run.plot_eval_loss() == run.path / "eval_loss.png"

    def unknown_symbol(rows, out):
        raise ValueError("Unknown symbol: \\foo")

    monkeypatch.setattr(plots, "eval_loss", unknown_symbol)
    assert run.plot_eval_loss() is None
    (error,) = [r.getMessage() for r in plot_log.records if r.levelno == logging.ERROR]
    assert "eval_loss.png" in error and "Unknown symbol" in error
