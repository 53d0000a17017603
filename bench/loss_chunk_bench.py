"""The training loss with the lm_head in chunks (``train.loss-chunk-tokens``) against all answer logits at once.

    python -m bench.loss_chunk_bench [--chunks 0,1024,256] [--answer-tokens 2048] [--steps 3]

One training micro-batch whose answers are long (the XSum client's prompts, articles as the bank clips them to
``data.max-prompt-chars``, as the answers, so every one of their tokens carries the loss), SmolLM2-135M NF4 with the
demo's LoRA, one fresh process per chunk size: the peak memory of the process (``ru_maxrss``; the model's own share
is the same in every row), the median seconds of a step (forward, backward), and the step's loss (the same in every
row, to float rounding). On a CPU the logits are a share of the peak; on a GPU, with a 128k vocabulary, they are
what ``chunk_tokens`` bounds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(chunk: int, answer_tokens: int, steps: int) -> dict:
    """In this process: ``steps`` training steps on the micro-batch with ``chunk``; its numbers."""
    import torch

    import common  # noqa: F401  (bitsandbytes' import, as every process of ours does)
    from common.adapters import attach_lora
    from common.adapters.lora import LoraSection
    from common.config import DataSection, TrainSection
    from common.data import Example, client_data
    from common.model import load_base_model, load_tokenizer
    from common.training import IGNORE, accumulate_batch, encode

    torch.manual_seed(0)
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = attach_lora(load_base_model("smollm2-135m-instruct", "nf4", "cpu"), LoraSection(), seed=0)
    model.train()
    articles, _ = client_data(DataSection(), 2, 3, seed=0)  # the XSum client: its prompts hold the (clipped) articles
    long = [Example("xsum", "Write the article this summary is about: " + e.answer, e.prompt) for e in articles]
    batch, total = [], 0
    for example in long:  # examples until the batch holds answer_tokens
        encoded = encode(tokenizer, example, 1024)
        batch.append(encoded)
        total += sum(label != IGNORE for label in encoded.labels[1:])
        if total >= answer_tokens:
            break
    cfg = TrainSection(batch_size=len(batch), loss_chunk_tokens=chunk)
    seconds, losses = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        began = time.perf_counter()
        losses.append(accumulate_batch(model, batch, tokenizer.pad_token_id, cfg, "cpu"))
        seconds.append(time.perf_counter() - began)
    return {
        "chunk_tokens": chunk,
        "examples": len(batch),
        "answer_tokens": total,
        "vocabulary": model.get_output_embeddings().weight.shape[0],
        "step_seconds": statistics.median(seconds),
        "loss": losses[0],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="0,1024,256")
    parser.add_argument("--answer-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="bench/results/loss_chunk.json")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, args.answer_tokens, args.steps)))
        return []
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        cmd = [sys.executable, "-m", "bench.loss_chunk_bench", "--one", str(chunk)]
        cmd += ["--answer-tokens", str(args.answer_tokens), "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
