"""What the CUDA 4-bit checks share (``pqlora_cuda_check.py``, ``sublora_cuda_check.py``, ``experts_cuda_check.py``):
random-weight checkpoints of real model shapes (GPU machines here have no model hub), a seeded batch, timed AdamW
steps, the peft LoRA r = 8 reference every check compares with, the row every check prints and the loop over the
shapes. Needs CUDA and bitsandbytes to run; imports without them.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from common.adapters import attach_lora
from common.adapters.lora import LoraSection
from common.model import load_base_model

# the real architectures, random-initialised: SmolLM2-135M (Llama) and Qwen2.5-0.5B (Qwen2)
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
    """A seeded random-weight bf16 model of architecture ``kind`` and ``shape``, saved to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, max_position_embeddings=1024, tie_word_embeddings=True, **shape)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


def step_seconds(model, batch, steps: int = 10) -> tuple[list[float], float]:
    """AdamW on ``model``'s trainable parameters, ``steps`` timed steps after 3 warm-up ones: every step's loss and
    the mean seconds of a timed step."""
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


def checkpoint_and_batch(name: str, kind: str, shape: dict, work: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The random-weight checkpoint of ``kind`` and ``shape`` under ``work / name``, and the seeded batch for it."""
    return random_checkpoint(kind, shape, work / name), random_batch(shape)


def lora_reference(path: Path, batch: dict[str, torch.Tensor]) -> dict:
    """peft LoRA r = 8 on a fresh NF4 load of ``path``: its losses and step time, the row every check compares with."""
    lora = attach_lora(load_base_model(str(path), "nf4", "cuda"), LoraSection(r=8), seed=0)
    losses, step = step_seconds(lora, batch)
    return {"lora_loss_first_last": [losses[0], losses[-1]], "lora_step_ms_8x256": 1000 * step}


def model_row(name: str, layers_key: str, layers: list, fields: dict, reference: dict) -> dict:
    """One model's JSON row: its name, the GPU, how many layers the adapter wraps (under ``layers_key``) and whether
    each is a bitsandbytes ``Linear4bit`` underneath, the check's own ``fields``, the LoRA ``reference`` and the peak
    GPU memory."""
    import bitsandbytes as bnb

    return {
        "model": name,
        "gpu": torch.cuda.get_device_name(),
        layers_key: len(layers),
        "all_linear4bit_underneath": all(isinstance(m.base_layer, bnb.nn.Linear4bit) for m in layers),
        **fields,
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
