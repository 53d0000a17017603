"""Benchmark SimGrad (FedMosaic) against FedAvg-LoRA and local-only training on the same heterogeneous clients.

    python bench/simgrad_bench.py --rounds 2 --clients 6

Every configuration runs the same clients (partition i: task ``tasks[i % 2]``, base model ``models[i % 3]`` —
SmolLM2-135M and Qwen2.5-Coder-0.5B, both real, both 4-bit), the same seeds and the same local steps:
- FedAvg-LoRA: peft LoRA averaged within each model family (LoRA shapes differ across base models);
- SimGrad (plain): PQ-LoRA, exact relevance-weighted personalised mixing;
- SimGrad (secure): the same through SecAgg+ groups of >= 3 clients;
- local-only: PQ-LoRA with the identity mixing matrix (each client keeps its own P/Q).
Writes ``bench/results/simgrad.json`` and ``bench/results/simgrad.md``: per client the final held-out loss, exact
match and ROUGE-L of each configuration, bytes per client per round, and for the SimGrad runs the mean relevance
between clients of the same task family vs different families.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.local_sim import flwr_run, prepare_home, stop_superlink  # noqa: E402
from strategies.simgrad.relevance import within_across_relevance  # noqa: E402

SMOL, QWEN = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
CONFIGS = {
    "fedavg-lora": "strategy='fedavg'",
    "simgrad-plain": "strategy='simgrad' secure=false",
    "simgrad-secure": "strategy='simgrad' secure=true",
    "local-only": "strategy='simgrad' simgrad.mixing='local-only'",
}


def client_rows(rows: list[dict], server_round: int) -> dict[int, dict]:
    return {
        r["partition_id"]: r
        for r in rows
        if r["round"] == server_round and r["node"] is not None and r.get("partition_id") is not None
    }


def relevance_summary(rows: list[dict]) -> dict:
    """Mean within- vs across-family relevance per round (families: task, and base model for contrast)."""
    # A row with a partition id is a client's eval row, which always carries its tasks and model.
    tasks = {r["partition_id"]: r["tasks"] for r in rows if r.get("partition_id") is not None}
    models = {r["partition_id"]: r["model"] for r in rows if r.get("partition_id") is not None}
    out = []
    for row in (r for r in rows if r["node"] is None and r.get("relevance")):
        scores, parts = np.asarray(row["relevance"]), row["relevance_partitions"]
        task_in, task_out = within_across_relevance(scores, [tasks[p] for p in parts])
        model_in, model_out = within_across_relevance(scores, [models[p] for p in parts])
        out.append(
            {
                "round": row["round"],
                "same_task": task_in,
                "other_task": task_out,
                "same_model": model_in,
                "other_model": model_out,
            }
        )
    return (
        {
            "per_round": out,
            **{
                k: float(np.mean([o[k] for o in out])) for k in ("same_task", "other_task", "same_model", "other_model")
            },
        }
        if out
        else {}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    parser.add_argument(
        "--extra",
        default="train.local-steps=4 eval.max-examples=6 eval.max-new-tokens=8",
        help="more --run-config overrides",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "simgrad"))
    args = parser.parse_args()

    common = (
        f"num-server-rounds={args.rounds} min-train-replies=3 seed=0 data.tasks='boolq,asdiv' "
        f"model.partition-models='{SMOL},{SMOL},{QWEN}' {args.extra}"
    )
    work = Path(tempfile.mkdtemp(prefix="tessera-simgrad-bench-"))
    home = prepare_home(work / "flwr-home")
    report: dict = {"rounds": args.rounds, "clients": args.clients, "common": common, "configs": {}}
    try:
        for name in args.configs.split(","):
            run_dir = work / name
            started = time.perf_counter()
            proc = flwr_run(
                home, f"{common} {CONFIGS[name]} run-dir='{run_dir}'", num_clients=args.clients, timeout=7200
            )
            if proc.returncode != 0 or not (run_dir / "metrics.jsonl").exists():
                raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            final, first = client_rows(rows, args.rounds), client_rows(rows, 0)
            trained = [r for r in rows if r["round"] >= 1 and r["node"] is not None]
            report["configs"][name] = {
                "seconds": time.perf_counter() - started,
                "clients": {
                    pid: {k: r.get(k) for k in ("model", "tasks", "eval_loss", "exact_match", "rouge_l")}
                    | {"round0_eval_loss": first[pid]["eval_loss"]}
                    for pid, r in sorted(final.items())
                },
                "bytes_up_per_client_round": float(np.mean([r["bytes_up"] for r in trained])),
                "adapter_bytes_up_per_client_round": float(
                    np.mean([r["bytes_up"] - r.get("signature_bytes", 0) for r in trained])
                ),
                "bytes_down_per_client_round": float(np.mean([r["bytes_down"] for r in trained])),
                "relevance": relevance_summary(rows),
                "align_error": [
                    float(np.nanmean([r.get(k) or np.nan for r in trained]))
                    for k in ("align_error_before", "align_error_after")
                ],
                "run_dir": str(run_dir),
            }
            print(f"{name}: {report['configs'][name]['seconds']:.0f} s", flush=True)
    finally:
        stop_superlink(home)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(table(report))
    print(table(report))


def table(report: dict) -> str:
    names = list(report["configs"])
    any_cfg = report["configs"][names[0]]["clients"]
    lines = [f"Held-out loss (EM / ROUGE-L) after {report['rounds']} rounds; round 0 = before training.\n"]
    lines.append("| client | model | task | round 0 | " + " | ".join(names) + " |")
    lines.append("|---" * (4 + len(names)) + "|")
    for pid, c in any_cfg.items():
        cells = []
        for n in names:
            r = report["configs"][n]["clients"].get(pid)
            cells.append(
                "-"
                if r is None or r["eval_loss"] is None
                else f"{r['eval_loss']:.3f} ({r['exact_match']:.2f} / {r['rouge_l']:.2f})"
            )
        lines.append(
            f"| {pid} | {c['model']} | {c['tasks']} | {c['round0_eval_loss']:.3f} | " + " | ".join(cells) + " |"
        )
    lines.append(
        "\n| config | bytes up / client / round (adapter + signature) | adapter only | bytes down "
        "| same-task relevance | other-task relevance | same-model | other-model | align error before -> after "
        "| seconds |"
    )
    lines.append("|---" * 10 + "|")
    for n in names:
        c = report["configs"][n]
        rel = c["relevance"] or {}

        def fmt(k: str, rel: dict = rel) -> str:
            return f"{rel[k]:.3f}" if k in rel else "-"

        align = "-" if np.isnan(c["align_error"][0]) else f"{c['align_error'][0]:.3f} -> {c['align_error'][1]:.3f}"
        lines.append(
            f"| {n} | {c['bytes_up_per_client_round']:,.0f} | {c['adapter_bytes_up_per_client_round']:,.0f} "
            f"| {c['bytes_down_per_client_round']:,.0f} | {fmt('same_task')} | {fmt('other_task')} "
            f"| {fmt('same_model')} | {fmt('other_model')} | {align} | {c['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
