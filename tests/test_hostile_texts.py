"""A hostile member's text through a whole run (the real ServerApp and ClientApp, in-process simulation, tiny
model): an ATLAS member that reports its tasks as ``$\\foo$`` (matplotlib math text, which raised in every figure
labelled with it and so stopped the ServerApp at round 1's plot). The run completes, every figure drawn."""

from __future__ import annotations

import json

import pytest
from child import SIMULATION_BACKEND, run_in_child
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

MATH_TEXT = "$\\foo$"


def _report_tasks(partition: int, tasks: str) -> None:
    """Make the client of ``partition`` in this worker process report ``tasks`` (its own code is hostile)."""
    from client_app.runtime import ClientRuntime

    honest = ClientRuntime.identity
    if getattr(honest, "hostile", False):
        return

    def identity(self: ClientRuntime) -> dict:
        out = honest(self)
        return {**out, "tasks": tasks} if self.partition_id == partition else out

    identity.hostile = True  # type: ignore[attr-defined]
    ClientRuntime.identity = identity  # type: ignore[method-assign]


def run_with_tasks(run_config: dict, nodes: int, partition: int, tasks: str) -> None:
    """The real ServerApp and ClientApp handlers with ``run_config`` (as ``test_toy_strategy.run_in_process``),
    the client of ``partition`` reporting ``tasks`` in every reply."""
    client = ClientApp()

    def handle(kind: str, msg: Message, context: Context) -> Message:
        from client_app.handlers import handle as real_handle

        _report_tasks(partition, tasks)
        ours = Context(context.run_id, context.node_id, dict(context.node_config), context.state, dict(run_config))
        return real_handle(kind, msg, ours)

    client.query()(lambda msg, context: handle("query", msg, context))
    client.train()(lambda msg, context: handle("train", msg, context))
    client.evaluate()(lambda msg, context: handle("evaluate", msg, context))
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from server_app.app import run_federation

        context.run_config = dict(run_config)
        run_federation(grid, context)

    run_simulation(server_app=server, client_app=client, num_supernodes=nodes, backend_config=SIMULATION_BACKEND)


@pytest.mark.e2e
def test_an_atlas_run_with_a_member_whose_tasks_are_math_text_completes_with_every_figure(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = {
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "strategy": "atlas",
        "num-server-rounds": 1,
        "min-train-replies": 3,
        "train.local-steps": 1,
        "train.batch-size": 2,
        "eval.max-examples": 2,
        "eval.max-new-tokens": 1,
        "run-dir": str(run_dir),
        "node-wait-timeout": 120.0,
    }
    run_in_child("test_hostile_texts", "run_with_tasks", cfg, 3, 0, MATH_TEXT, timeout=900)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    aggregate = next(r for r in rows if r["round"] == 1 and r["node"] is None)
    (family,) = aggregate["atlas"].values()
    assert MATH_TEXT in family["tasks"], family["tasks"]  # the server took the member's text as it was
    assert any(r.get("tasks") == MATH_TEXT for r in rows if r["round"] == 1 and r["node"] is not None)
    assert len([r for r in rows if r["round"] == 1 and r.get("accepted")]) == 3
    figures = [run_dir / "eval_loss.png", run_dir / "cluster-loss.png", *(run_dir / "clusters").glob("round-001-*.png")]
    assert len(figures) == 3 and all(f.stat().st_size > 5_000 for f in figures), figures
    assert any((run_dir / "adapters").iterdir())  # the run went on to its end: the cluster adapters were saved
