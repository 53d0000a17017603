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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cuda_common import checkpoint_and_batch, lora_reference, model_row, run_checks, step_seconds  # noqa: E402
from common.adapters.pqlora import PQLoraConfig, adapters_disabled, attach_pqlora, get_pq_arrays  # noqa: E402
from common.model import load_base_model  # noqa: E402


def check(name: str, kind: str, shape: dict, work: Path) -> dict:
    path, batch = checkpoint_and_batch(name, kind, shape, work)

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
    fields = {
        "init_equals_base": bool(torch.equal(adapted, base)),
        "pq_loss_first_last": [pq_losses[0], pq_losses[-1]],
        "pq_loss_fell": pq_losses[-1] < pq_losses[0],
        "pq_floats_sent": floats,
        "pq_step_ms_8x256": 1000 * pq_step,
    }
    return model_row(name, "adapted_layers", wrapped, fields, reference)


if __name__ == "__main__":
    run_checks(check)
