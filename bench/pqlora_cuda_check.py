"""PQ-LoRA on the CUDA 4-bit path: correctness and speed on a GPU, with random-weight models of real shapes.

    python bench/pqlora_cuda_check.py            # needs CUDA and bitsandbytes

GPU machines here have no model hub and no registry, so the models are random-initialised with the real
architectures (SmolLM2-135M: Llama, width 576, 30 layers; Qwen2.5-0.5B: Qwen2, width 896, 24 layers). For each:
load in NF4 with bf16 compute through ``common.model.load_base_model``, attach PQ-LoRA, check that the adapted
layers are bitsandbytes ``Linear4bit`` underneath and that the output at init equals the base output, train
AdamW steps on a fixed batch (loss must fall), and time a training step of PQ-LoRA vs peft LoRA (r=8, q/v, all
blocks). Prints one JSON object per model.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.adapters import attach_lora  # noqa: E402
from common.adapters.lora import LoraSection  # noqa: E402
from common.adapters.pqlora import PQLoraConfig, adapters_disabled, attach_pqlora, get_pq_arrays  # noqa: E402
from common.model import load_base_model  # noqa: E402

SHAPES = {
    "smollm2-135m-shape": (
        "llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
        ),
    ),
    "qwen2.5-0.5b-shape": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
    ),
}


def random_checkpoint(kind: str, shape: dict, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, max_position_embeddings=1024, tie_word_embeddings=True, **shape)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


def step_seconds(model, batch, steps: int = 10) -> tuple[list[float], float]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for i in range(steps + 3):
        if i == 3:  # warm-up done
            torch.cuda.synchronize()
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    torch.cuda.synchronize()
    return losses, (time.perf_counter() - started) / steps


def random_batch(shape: dict) -> dict[str, torch.Tensor]:
    """8 x 256 random tokens of the shape's vocabulary on the GPU (seeded), as their own labels."""
    torch.manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (8, 256), device="cuda")
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def lora_reference(path: Path, batch: dict[str, torch.Tensor]) -> dict:
    """peft LoRA r = 8 on a fresh NF4 load of ``path``: its losses and step time, the row every check compares with."""
    lora = attach_lora(load_base_model(str(path), "nf4", "cuda"), LoraSection(r=8), seed=0)
    losses, step = step_seconds(lora, batch)
    return {"lora_loss_first_last": [losses[0], losses[-1]], "lora_step_ms_8x256": 1000 * step}


def check(name: str, kind: str, shape: dict, work: Path) -> dict:
    import bitsandbytes as bnb

    path = random_checkpoint(kind, shape, work / name)
    batch = random_batch(shape)

    model = attach_pqlora(load_base_model(str(path), "nf4", "cuda"), PQLoraConfig(r=8, num_blocks=4, scaling=4.0))
    wrapped = [m for m in model.modules() if type(m).__name__ == "PQLoraLinear"]
    with torch.no_grad():
        adapted = model(**batch).logits
        with adapters_disabled(model):
            base = model(**batch).logits
    pq_losses, pq_step = step_seconds(model, batch)
    floats = sum(a.size for a in get_pq_arrays(model).values())
    del model
    torch.cuda.empty_cache()

    reference = lora_reference(path, batch)
    return {
        "model": name,
        "gpu": torch.cuda.get_device_name(),
        "adapted_layers": len(wrapped),
        "all_linear4bit_underneath": all(isinstance(m.base_layer, bnb.nn.Linear4bit) for m in wrapped),
        "init_equals_base": bool(torch.equal(adapted, base)),
        "pq_loss_first_last": [pq_losses[0], pq_losses[-1]],
        "pq_loss_fell": pq_losses[-1] < pq_losses[0],
        "pq_floats_sent": floats,
        "pq_step_ms_8x256": 1000 * pq_step,
        **reference,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20,
    }


def run_checks(check_one) -> None:
    """``check_one(name, kind, shape, work_dir)`` for every shape, one JSON line each (needs CUDA)."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, shape) in SHAPES.items():
            print(json.dumps(check_one(name, kind, shape, Path(tmp))), flush=True)


def main() -> None:
    run_checks(check)


if __name__ == "__main__":
    main()
