"""What a record-level DP-SGD step costs against a plain one, on the real model.

    python -m bench.dpsgd_bench [--steps 8] [--batch 2] [--out docs/results/dpsgd-cost/dpsgd_cost.json]

SmolLM2-135M in NF4 with the demo's LoRA, the demo's first client's training split (``common.data.client_data``),
one fresh process per mode: ``plain`` (``common.training.train_round``: batches of ``--batch``, packed) and ``dp-sgd``
(``common.dpsgd.private_train_round``: Poisson batches of ``--batch`` expected examples, each example's gradient on
its own, clipped to 1, noise multiplier 1). Per mode: the median seconds of a step, the examples it saw, the
seconds per example and the peak memory of the process (``ru_maxrss``; the model's own share is the same in both).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def one(mode: str, steps: int, batch: int) -> dict:
    """In this process: ``steps`` steps of ``mode``; its numbers."""
    import torch

    import common  # noqa: F401  (bitsandbytes' import, as every process of ours does)
    from common.adapters import attach_lora
    from common.adapters.lora import LoraSection
    from common.config import DataSection, TrainSection
    from common.data import client_data
    from common.dpsgd import private_train_round
    from common.model import load_base_model, load_tokenizer
    from common.training import train_round

    torch.manual_seed(0)
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = attach_lora(load_base_model("smollm2-135m-instruct", "nf4", "cpu"), LoraSection(), seed=0)
    train, _ = client_data(DataSection(), 0, 3, seed=0)
    cfg = TrainSection(local_steps=steps, batch_size=batch)
    began = time.perf_counter()
    if mode == "plain":
        metrics = train_round(model, tokenizer, train, cfg, 1e-3, seed=0)
        seen = metrics["train_examples"]
    else:
        metrics = private_train_round(model, tokenizer, train, cfg, 1e-3, batch / len(train), 1.0, 1.0)
        seen = metrics["train_sampled"]
    seconds = time.perf_counter() - began
    return {
        "mode": mode,
        "steps": steps,
        "records": len(train),
        "examples_seen": seen,
        "step_seconds": seconds / steps,
        "seconds_per_example": seconds / max(seen, 1),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", default="docs/results/dpsgd-cost/dpsgd_cost.json")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, args.steps, args.batch)))
        return []
    rows = []
    for mode in ("plain", "dp-sgd"):
        cmd = [sys.executable, "-m", "bench.dpsgd_bench", "--one", mode, "--steps", str(args.steps)]
        done = subprocess.run([*cmd, "--batch", str(args.batch)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
