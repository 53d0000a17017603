"""A plain Hugging Face QLoRA loop against Tessera's client training path, on the same shapes, data and LoRA.

    python -m bench.gpu_bench [--shapes llama-1b,llama-7b] [--checkpointing off,on] [--batch 8] [--seq 512]
                              [--steps 8] [--out bench/results/gpu.json]
    python -m bench.gpu_bench --shapes tiny --steps 2    # on a CPU: keeps the script working (tests/test_gpu_bench.py)

Both loops train LoRA r = 16 (alpha 32) on every linear layer of a random-initialised model of a real architecture's
shape (GPU machines here have no model hub) in NF4 with bf16 compute on CUDA (fp32 on a CPU), AdamW, on the same
batches: synthetic conversations whose prompt and answer lengths spread as instruction data does (prompts 32 to
seq - 64 tokens, answers 8 to 64, seeded), the loss on the answer tokens only (the useful tokens).

- ``plain``: what a user writes with transformers + peft + bitsandbytes: ``prepare_model_for_kbit_training``,
  ``get_peft_model``, batches padded to their longest example, ``model(**batch).loss`` over every position's logits.
- ``tessera`` variants: ``common.model.load_base_model`` + ``attach_lora`` and ``common.training.accumulate_batch``
  with ``train.loss-logits='labelled'`` (the lm_head only where an answer token is predicted), padded
  (``tessera``) and padding-free (``tessera-packed``).

Each variant: warm-up steps, then ``--steps`` timed ones; per variant the median step seconds, useful tokens a
second (answer tokens; the same tokens for every variant), all tokens a second (every non-pad token), the first
step's loss (every variant starts from the same base model, LoRA B = 0, so these agree) and peak memory (CUDA: the
allocator's peak; CPU: the process's peak RSS, which only grows, so read it in order). ``--checkpointing on`` turns
on gradient checkpointing in both (``model.gradient-checkpointing``).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.cuda_common import random_checkpoint
from common.training import IGNORE, Encoded, accumulate_batch, collate

# Llama 3.2 1B and Llama 2 7B (the reference shapes), and a tiny one for CPUs
SHAPES: dict[str, dict[str, int]] = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD = 0


def synthetic_batches(vocab: int, seq: int, batch: int, count: int, seed: int = 0) -> list[list[Encoded]]:
    """``count`` batches of ``batch`` examples: random tokens, prompt and answer lengths spread (seeded)."""
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        examples = []
        for _ in range(batch):
            answer = rng.randint(8, min(64, seq // 4))
            prompt = rng.randint(min(32, seq - answer - 1), seq - answer)
            ids = [rng.randrange(1, vocab) for _ in range(prompt + answer)]
            examples.append(Encoded(ids, [IGNORE] * prompt + ids[prompt:]))
        batches.append(examples)
    return batches


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def plain_model(path: Path, checkpointing: bool, cuda: bool):
    """The loop a user writes: transformers + bitsandbytes NF4 + peft, all linear layers, r = 16."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = torch.bfloat16 if cuda else torch.float32
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=dtype, device_map="cuda" if cuda else "cpu"
    )
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    model.config.use_cache = False
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LINEAR, task_type="CAUSAL_LM"))


def tessera_model(path: Path, checkpointing: bool, cuda: bool):
    from common.adapters import attach_lora
    from common.adapters.lora import LoraSection
    from common.model import load_base_model

    base = load_base_model(str(path), "nf4", "cuda" if cuda else "cpu", gradient_checkpointing=checkpointing)
    return attach_lora(base, LoraSection(r=16, alpha=32, target_modules=LINEAR))


def run_variant(model, variant: str, batches: list[list[Encoded]], warmup: int) -> dict[str, Any]:
    from common.config import TrainSection

    device = next(p for p in model.parameters() if p.requires_grad).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    cfg = TrainSection(batch_size=len(batches[0]), packing=variant == "tessera-packed", loss_logits="labelled")
    model.train()
    seconds, losses = [], []
    for i, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        if variant == "plain":
            inputs = {k: v.to(device) for k, v in collate(batch, PAD).items()}
            loss = model(**inputs).loss
            loss.backward()
            value = float(loss.detach())
        else:
            value = accumulate_batch(model, batch, PAD, cfg, device)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            seconds.append(time.perf_counter() - started)
        losses.append(value)
    timed = batches[warmup:]
    useful = sum(sum(label != IGNORE for label in e.labels[1:]) for b in timed for e in b)
    tokens = sum(len(e.input_ids) for b in timed for e in b)
    return {
        "median_step_seconds": statistics.median(seconds),
        "useful_tokens_per_second": useful / sum(seconds),
        "tokens_per_second": tokens / sum(seconds),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "peak_memory_mb": peak_memory_mb(device),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-1b,llama-7b")
    parser.add_argument("--checkpointing", default="off,on")
    parser.add_argument("--variants", default="plain,tessera,tessera-packed")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="bench/results/gpu.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "batch": args.batch,
        "seq": args.seq,
        "lora": "r=16 alpha=32 on " + ",".join(LINEAR),
        "rows": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            path = random_checkpoint("llama", SHAPES[shape], Path(tmp) / shape)
            batches = synthetic_batches(SHAPES[shape]["vocab_size"], args.seq, args.batch, args.warmup + args.steps)
            for checkpointing in (c == "on" for c in args.checkpointing.split(",")):
                for variant in args.variants.split(","):
                    if cuda:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    build = plain_model if variant == "plain" else tessera_model
                    model = build(path, checkpointing, cuda)
                    row = {"shape": shape, "checkpointing": checkpointing, "variant": variant}
                    row.update(run_variant(model, variant, batches, args.warmup))
                    del model
                    result["rows"].append(row)
                    print(f"[gpu_bench] {json.dumps(row)}", flush=True)
                    out.write_text(json.dumps(result, indent=1))  # what finished survives a time limit
    return result


if __name__ == "__main__":
    main()
