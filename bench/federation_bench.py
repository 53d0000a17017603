"""Benchmark a short federation, plain vs SecAgg+, on the real 4-bit model: where does a round's time go?

    python bench/federation_bench.py --rounds 2 --clients 3

Writes ``bench/results/federation.json`` and prints a table. Per round: wall time, split into model load (once
per client process), local training, evaluation, server aggregation and the rest (messaging, SecAgg+ protocol,
Ray); model load is reported apart, as it happens before round 0's clock starts; train tokens per second; peak
client memory; adapter bytes per client per direction.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.local_sim import flwr_run, prepare_home, stop_superlink  # noqa: E402


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    loaded: set[int | None] = set()  # process ids (None: a row that reports none)
    for rnd in sorted({r["round"] for r in rows}):
        clients = [r for r in rows if r["round"] == rnd and r["node"] is not None]
        agg = next(r for r in rows if r["round"] == rnd and r["node"] is None)
        load = 0.0
        for r in clients:  # a process's load time is counted in the first round it shows up
            if r.get("pid") not in loaded:
                loaded.add(r.get("pid"))
                load += r.get("model_load_seconds") or 0.0
        train = sum(r.get("train_seconds") or 0.0 for r in clients)
        evaluate = sum(r.get("eval_seconds") or 0.0 for r in clients)
        aggregate = agg.get("aggregate_seconds") or 0.0
        tokens = sum(r.get("train_tokens") or 0 for r in clients)
        out.append(
            {
                "round": rnd,
                "wall_seconds": agg["seconds"],
                "model_load_seconds": load,
                "train_seconds": train,
                "eval_seconds": evaluate,
                "aggregate_seconds": aggregate,
                # the model loads on a process's first message (the initial-adapter query, before round 0's clock)
                "other_seconds": agg["seconds"] - train - evaluate - aggregate,
                "train_tokens_per_second": tokens / train if train else None,
                "peak_client_rss_mb": max((r.get("peak_rss_mb") or 0.0) for r in clients),
                "bytes_up_per_client": sum(r["bytes_up"] for r in clients) / len(clients),
                "bytes_down_per_client": sum(r["bytes_down"] for r in clients) / len(clients),
                "eval_loss": agg["eval_loss"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--extra", default="", help="more --run-config overrides")
    parser.add_argument("--modes", default="plain,secure", help="which of plain and secure to run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "federation.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    home = prepare_home(work / "flwr-home")
    report = {"rounds": args.rounds, "clients": args.clients, "extra": args.extra, "modes": {}}
    try:
        for mode in args.modes.split(","):
            run_dir = work / mode
            secure = "true" if mode == "secure" else "false"
            cfg = (
                f"num-server-rounds={args.rounds} secure={secure} min-train-replies=3 run-dir='{run_dir}' {args.extra}"
            )
            started = time.perf_counter()
            proc = flwr_run(home, cfg, num_clients=args.clients, timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            report["modes"][mode] = {"total_seconds": time.perf_counter() - started, "rounds": summarise(rows)}
    finally:
        stop_superlink(home)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    cols = [
        "round",
        "wall_seconds",
        "model_load_seconds",
        "train_seconds",
        "eval_seconds",
        "aggregate_seconds",
        "other_seconds",
        "train_tokens_per_second",
        "peak_client_rss_mb",
        "bytes_up_per_client",
        "bytes_down_per_client",
        "eval_loss",
    ]
    print("| mode | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
    for mode, data in report["modes"].items():
        for row in data["rounds"]:
            print(f"| {mode} | " + " | ".join(_fmt(row[c]) for c in cols) + " |")
        print(f"| {mode} total | {data['total_seconds']:.1f} s |" + " |" * (len(cols) - 1))
    print(f"written to {args.out}")


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


if __name__ == "__main__":
    main()
