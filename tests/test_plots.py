"""Run plots group a client's rows by partition, so a resumed simulation (new node ids) keeps one line per client."""

from __future__ import annotations

from common.plots import client_key, client_keys, client_label, eval_loss


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
