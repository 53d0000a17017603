"""Training-step layouts on the real model: padded or packed (padding-free) batches, the loss from every position's
logits or from the labelled positions' only; seconds a step and useful tokens a second.

    python -m bench.packing_bench [--batch 2,8] [--steps 6] [--tasks asdiv,boolq,xsum,commonsenseqa]
                                  [--modes padded+all,padded+labelled,packed+labelled]
                                  [--out bench/results/packing.json]

Loads SmolLM2 in NF4 with the default LoRA on this machine's device, takes real training examples of several tasks
(their lengths differ, as a client's do), and for each batch size runs every mode on the same batches, one step of
each in turn (``train.packing``: ``common.training.pack``; ``train.loss-logits``: ``common.training.labelled_loss``),
so that whatever else the machine does falls on all of them. Writes per mode: seconds per step (median), tokens a
second counting every token the model computed (padded: the padding too), useful tokens a second (those that carry a
loss) and that against the first mode's, the share of the padded batch that was padding, and the largest loss
difference between the modes on the same batch (they must agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="2,8")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tasks", default="asdiv,boolq,xsum,commonsenseqa")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="padded+all,padded+labelled,packed+labelled")
    parser.add_argument("--out", default="bench/results/packing.json")
    args = parser.parse_args(argv)
    import torch

    from common.adapters import attach_lora
    from common.adapters.lora import LoraSection
    from common.config import DataSection, TrainSection
    from common.data import client_data
    from common.model import load_base_model, load_tokenizer
    from common.training import accumulate_batch, answer_token_count, encode

    tokenizer = load_tokenizer(args.model)
    model = attach_lora(load_base_model(args.model, "nf4", "auto", cpu_packed_inference=False), LoraSection())
    device = next(p for p in model.parameters() if p.requires_grad).device
    model.train()
    train, _ = client_data(DataSection(tasks=args.tasks.split(",")), 0, 1, seed=0)
    encoded = [encode(tokenizer, e, TrainSection().max_seq_len) for e in train]
    result: dict[str, Any] = {"model": args.model, "device": str(device), "steps": args.steps, "batches": {}}
    modes = args.modes.split(",")  # "<padded|packed>+<loss-logits>": the first is the reference
    for size in (int(b) for b in args.batch.split(",")):
        timing: dict[str, list[float]] = {m: [] for m in modes}
        diffs, computed, useful = [], {m: 0 for m in modes}, 0
        for step in range(args.steps):
            batch = encoded[step * size : (step + 1) * size]
            useful += sum(answer_token_count(e) for e in batch)
            losses = {}
            for mode in modes:
                layout, logits = mode.split("+")
                computed[mode] += (
                    sum(len(e.input_ids) for e in batch)
                    if layout == "packed"
                    else len(batch) * max(len(e.input_ids) for e in batch)
                )
                cfg = TrainSection(batch_size=size, packing=layout == "packed", loss_logits=logits)
                model.zero_grad(set_to_none=True)
                started = time.perf_counter()
                losses[mode] = accumulate_batch(model, batch, tokenizer.pad_token_id, cfg, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                timing[mode].append(time.perf_counter() - started)
            diffs.append(max(abs(losses[m] - losses[modes[0]]) for m in modes))
        row: dict[str, Any] = {
            "padding_share": 1 - min(computed.values()) / max(computed.values()),
            "loss_max_diff": max(diffs),
        }
        for mode, seconds in timing.items():
            total = sum(seconds)
            row[mode] = {
                "median_step_seconds": statistics.median(seconds),
                "tokens_per_second": computed[mode] / total,
                "useful_tokens_per_second": useful / total,
                "speedup": sum(timing[modes[0]]) / total,  # useful tokens a second against the first mode's
            }
        result["batches"][str(size)] = row
        print(f"[packing] batch {size}: {json.dumps(row)}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
