"""A node's start-up on its own data, small and large: seconds and peak memory from nothing to the end of its first
training round, for a chat JSONL file of 2,000 and of 200,000 conversations (issue: "a node with 200,000 examples
starts its first round without holding every tokenised example in memory twice").

    python -m bench.own_data_bench --sizes 2000,200000 --out docs/results/own-data

Each size runs in a fresh process (its peak RSS is its own): the client runtime as a SuperNode's ClientApp builds it
(``client_app.runtime.get_runtime``: the 4-bit model, the LoRA adapter, the node's file read, split and its tokens
counted), then one round of ``train.local-steps`` steps. The file: the built-in bank's real text (BoolQ, ASDiv, XSum,
CommonsenseQA) as one-turn chat conversations with a system message, repeated with a numbered suffix until the size
is reached (each row distinct, so every one is hashed and split). Writes ``own-data.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.compare_merge import machine, machine_name


def write_file(path: Path, size: int) -> None:
    from common.config import DataSection
    from common.data import load_task_bank

    bank = load_task_bank(DataSection(max_examples_per_task=2000))
    with open(path, "w") as handle:
        for i in range(size):
            e = bank[i % len(bank)]
            turns = [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"{e.prompt} (item {i})"},
                {"role": "assistant", "content": e.answer},
            ]
            handle.write(json.dumps({"messages": turns}) + "\n")


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(path: str, steps: int) -> dict[str, Any]:
    """In this process: the runtime on ``path``, then one training round."""
    from flwr.app import Context, RecordDict

    started = time.perf_counter()
    from client_app import runtime
    from common.training import train_round

    imported = time.perf_counter() - started
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 1, "data-path": path},
        state=RecordDict(),
        run_config={"train.local-steps": steps},
    )
    rt = runtime.get_runtime(context)
    ready = time.perf_counter() - started
    rss_ready = rss_mb()
    rt.adapter.begin(rt.state, rt.adapter.initial)
    rt.adapter.prepare_training()
    settings = rt.cfg.train_settings()
    metrics = train_round(rt.model, rt.tokenizer, rt.train, settings, settings.learning_rate, seed=0)
    return {
        "examples": rt.data.counts["data-examples"],
        "counts": rt.data.counts,
        "import_seconds": imported,
        "model_load_seconds": runtime.model_load_seconds,
        "ready_seconds": ready,
        "first_round_end_seconds": time.perf_counter() - started,
        "train_seconds": metrics["train_seconds"],
        "train_loss": metrics["train_loss"],
        "peak_rss_mb_ready": rss_ready,
        "peak_rss_mb_after_round": rss_mb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2000,200000")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/own-data-bench")
    parser.add_argument("--work", default="/tmp/tessera-own-data-bench")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps)))
        return
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        path = work / f"chat-{size}.jsonl"
        if not path.exists():
            write_file(path, size)
        cmd = [sys.executable, "-m", "bench.own_data_bench", "--one", str(path), "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = {"size": size, "file_mb": path.stat().st_size / 2**20, **json.loads(done.stdout.splitlines()[-1])}
        rows.append(row)
        print(
            f"{size:>8,} examples ({row['file_mb']:.0f} MB): ready {row['ready_seconds']:.1f} s (model "
            f"{row['model_load_seconds']:.1f} s), first round ends {row['first_round_end_seconds']:.1f} s, peak RSS "
            f"{row['peak_rss_mb_ready']:.0f} MB ready / {row['peak_rss_mb_after_round']:.0f} MB after the round"
        )
    report = {"machine": machine(), "steps": args.steps, "rows": rows}
    (out / "own-data.json").write_text(json.dumps(report, indent=1))
    print(f"machine: {machine_name(report['machine'])}; report: {out / 'own-data.json'}")


if __name__ == "__main__":
    main()
