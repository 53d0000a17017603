"""VEMoE's expert pool on the CUDA 4-bit path: correctness and speed on a GPU, with random-weight models of real
shapes (GPU machines here have no model hub; the shapes and helpers are ``cuda_common.py``'s).

    python bench/experts_cuda_check.py            # needs CUDA and bitsandbytes

For each shape: load in NF4 with bf16 compute through ``common.model.load_base_model``, attach a pool of 4 experts
(rank 4, q/v of every block), check that every adapted layer is a bitsandbytes ``Linear4bit`` underneath, that the
output with nothing routed and with fresh (B = 0) experts routed equals the base output exactly, train AdamW steps
with tokens routed between two experts (loss must fall; only the routed slots get gradients), and time a training
step against peft LoRA r=8 on q/v. Prints one JSON object per model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cuda_common import checkpoint_and_batch, lora_reference, model_row, run_checks, step_seconds  # noqa: E402
from common.adapters.experts import ExpertLinear, ExpertsSection, attach_experts, routed, trainable  # noqa: E402
from common.model import load_base_model  # noqa: E402


def base_output(path: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a fresh NF4 load of ``path`` on ``batch``, the model freed again."""
    base = load_base_model(str(path), "nf4", "cuda")
    with torch.no_grad():
        logits = base(**batch).logits
    del base
    torch.cuda.empty_cache()
    return logits


def check(name: str, kind: str, shape: dict, work: Path) -> dict:
    path, batch = checkpoint_and_batch(name, kind, shape, work)

    model = attach_experts(load_base_model(str(path), "nf4", "cuda"), ExpertsSection(k_max=4, r=4, top_m=2), seed=0)
    layers = [m for m in model.modules() if isinstance(m, ExpertLinear)]
    with torch.no_grad():
        unrouted = model(**batch).logits
        with routed(model, [0, 2], [0.6, 0.4]):
            fresh = model(**batch).logits
    trainable(model)
    with routed(model, [0, 2], [0.6, 0.4]):
        losses, expert_step = step_seconds(model, batch)
    grad = layers[-1].lora_B.grad
    assert grad is not None, "no gradient reached the last expert layer"
    grads = grad.flatten(1).norm(dim=1).tolist()
    with torch.no_grad(), routed(model, [0, 2], [0.6, 0.4]):
        trained = model(**batch).logits
    del model
    torch.cuda.empty_cache()
    base_logits = base_output(path, batch)
    reference = lora_reference(path, batch)
    fields = {
        "unrouted_equals_base": bool(torch.equal(unrouted, base_logits)),
        "fresh_experts_equal_base": bool(torch.equal(fresh, base_logits)),
        "trained_differs_from_base": not bool(torch.equal(trained, base_logits)),
        "expert_loss_first_last": [losses[0], losses[-1]],
        "expert_loss_fell": losses[-1] < losses[0],
        "last_layer_grad_norm_per_slot": grads,
        "only_routed_slots_have_gradients": grads[1] == 0 and grads[3] == 0 and grads[0] > 0 and grads[2] > 0,
        "experts_step_ms_8x256": 1000 * expert_step,
    }
    return model_row(name, "adapted_layers", layers, fields, reference)


if __name__ == "__main__":
    run_checks(check)
