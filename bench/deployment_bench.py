"""Per-round cost of deployment vs simulation, and what the per-node model worker saves.

    python bench/deployment_bench.py --modes simulation,worker-off,worker-on --rounds 2 --clients 3
    python bench/deployment_bench.py --modes worker-on --name deployment-atlas \
        --run-config "strategy='atlas' secure=true data.tasks='boolq,asdiv' atlas.memory-mb='6,12,24'"

Runs the same federation (real 4-bit SmolLM2, same steps and evaluation) as a `flwr run` simulation and on a
TLS-authenticated loopback deployment (deploy/loopback.py: SuperLink + SuperNodes as processes, one thread per
node), with the node-local model worker off (Flower's fresh ClientApp process loads the model for every message)
and on. Writes ``bench/results/deployment.{json,md}``: per round the wall time and, per message, the ClientApp
start-up (process start until the model is ready: ``startup_seconds``, from the evaluate messages), model loads, and
every client's held-out loss per round. ``--run-config`` runs any strategy the same way (ATLAS, MIRA, SimGrad, secure
or not); ``--name`` names the result files so that such a run does not overwrite the FedAvg one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.local_sim import flwr_run, stop_superlink  # noqa: E402
from deploy.loopback import LoopbackFederation  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run_mode(mode: str, work: Path, rounds: int, clients: int, steps: int, examples: int, extra: str = "") -> dict:
    run_dir = work / mode / "run"
    config = (
        f"num-server-rounds={rounds} min-train-replies={clients} train.local-steps={steps} "
        f"eval.max-examples={examples} eval.max-new-tokens=8 run-dir='{run_dir}' {extra}"
    ).strip()
    started = time.perf_counter()
    if mode == "simulation":
        home = work / mode / "flwr-home"
        try:
            proc = flwr_run(home, config, num_clients=clients, timeout=3600)
        finally:
            stop_superlink(home)
    else:
        federation = LoopbackFederation(work / mode, clients, node_config=f'worker="{mode.split("-")[1]}"')
        try:
            federation.up()
            proc = federation.run(config, timeout=3600)
        finally:
            federation.close()
    wall = time.perf_counter() - started
    if not (run_dir / "metrics.jsonl").exists():
        raise RuntimeError(f"{mode}: the run wrote no metrics:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if proc.returncode != 0 or max(r["round"] for r in rows) != rounds:
        raise RuntimeError(f"{mode}: the run did not finish\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    per_round = []
    for rnd in range(rounds + 1):
        nodes = [r for r in rows if r["round"] == rnd and r["node"] is not None]
        agg = next(r for r in rows if r["round"] == rnd and r["node"] is None)
        per_round.append(
            {
                "round": rnd,
                "wall_seconds": agg["seconds"],
                "startup_seconds_mean": statistics.mean(r.get("startup_seconds") or 0.0 for r in nodes),
                "train_seconds_mean": statistics.mean(r.get("train_seconds") or 0.0 for r in nodes) if rnd else 0.0,
                "eval_seconds_mean": statistics.mean(r.get("eval_seconds") or 0.0 for r in nodes),
                "model_loads_max": max(r.get("model_loads") or 0 for r in nodes),
                "eval_loss": agg["eval_loss"],
                "client_loss": {
                    r["partition_id"]: r.get("eval_loss") for r in nodes if r.get("partition_id") is not None
                },
            }
        )
    log = proc.stdout + proc.stderr
    return {
        "mode": mode,
        "run_wall_seconds": wall,
        "rounds": per_round,
        "secagg": "SecAgg+" in log,
        "log_tail": log[-4000:],
    }


def markdown(results: list[dict], args) -> str:
    lines = [
        f"Deployment vs simulation: {args.clients} clients, {args.rounds} rounds, {args.steps} local steps, "
        f"{args.examples} eval examples, SmolLM2-135M NF4 on CPU ({time.strftime('%Y-%m-%d')}); "
        f"run config: {args.run_config or 'defaults (FedAvg)'}.",
        "",
        "| mode | round | round wall s | ClientApp start-up s (mean per message) | train s | eval s "
        "| model loads (max per node) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        for r in res["rounds"]:
            lines.append(
                f"| {res['mode']} | {r['round']} | {r['wall_seconds']:.1f} | {r['startup_seconds_mean']:.1f} | "
                f"{r['train_seconds_mean']:.1f} | {r['eval_seconds_mean']:.1f} | {r['model_loads_max']} |"
            )
    lines += ["", "| mode | round | held-out loss per partition |", "| --- | --- | --- |"]
    for res in results:
        for r in res["rounds"]:
            losses = ", ".join(f"{p}: {loss:.3f}" for p, loss in sorted(r["client_loss"].items()) if loss is not None)
            lines.append(f"| {res['mode']} | {r['round']} | {losses} |")
    lines.append("")
    lines.append("| mode | whole run incl. start-up s | SecAgg+ in the log |")
    lines.append("| --- | --- | --- |")
    lines += [f"| {res['mode']} | {res['run_wall_seconds']:.0f} | {res['secagg']} |" for res in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="simulation,worker-off,worker-on")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--examples", type=int, default=4)
    parser.add_argument("--run-config", default="", help="more run-config for every mode, e.g. \"strategy='mira'\"")
    parser.add_argument("--name", default="deployment", help="result files: bench/results/<name>.{json,md}")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="tessera-deploy-bench-") as tmp:
        for mode in args.modes.split(","):
            print(f"[bench] {mode} ...", flush=True)
            results.append(
                run_mode(mode, Path(tmp), args.rounds, args.clients, args.steps, args.examples, args.run_config)
            )
            print(markdown(results[-1:], args), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (RESULTS / f"{args.name}.md").write_text(markdown(results, args))
    print(markdown(results, args))


if __name__ == "__main__":
    main()
