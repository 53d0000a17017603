"""SubLoRA on the CUDA 4-bit path: correctness and speed on a GPU, with random-weight models of real shapes (GPU
machines here have no model hub; the shapes and helpers are ``cuda_common.py``'s).

    python bench/sublora_cuda_check.py            # needs CUDA and bitsandbytes

For each shape: load in NF4 with bf16 compute through ``common.model.load_base_model``, attach SubLoRA (d = 1,000,
Fastfood projection, learned allocation, q/v of every block), check that every wrapped layer is a bitsandbytes
``Linear4bit`` underneath and that alpha = 0 gives the base output exactly, train AdamW steps (the loss must fall;
alpha and the gates get gradients), export theta_0 + P alpha as a PEFT LoRA directory and load it on the same base
(its logits must match the SubLoRA model's to bf16 tolerance), and time a training step against peft LoRA r = 8.
Prints one JSON object per model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cuda_common import checkpoint_and_batch, lora_reference, model_row, run_checks, step_seconds  # noqa: E402
from common.adapters.sublora import SubLoraSection, SubspaceLoraLinear, attach_sublora  # noqa: E402
from common.adapters.sublora.model import save_materialised, subspace_of, trainable  # noqa: E402
from common.model import load_base_model  # noqa: E402


def has_gradient(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.abs().sum() > 0)


def check(name: str, kind: str, shape: dict, work: Path) -> dict:
    from peft import PeftModel

    path, batch = checkpoint_and_batch(name, kind, shape, work)
    section = SubLoraSection(intrinsic_dim=1000, allocation="learned")

    base = load_base_model(str(path), "nf4", "cuda")
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = attach_sublora(base, section)
    layers = [m for m in model.modules() if isinstance(m, SubspaceLoraLinear)]
    with torch.no_grad():
        at_zero = model(**batch).logits
    trainable(model)
    with torch.no_grad():  # from alpha = 0 the gates have no gradient (they only split alpha): start nearby
        subspace_of(model).alpha.normal_(0, 0.01)
    losses, sublora_step = step_seconds(model, batch)
    subspace = subspace_of(model)
    alpha_grad = subspace.alpha.grad
    gates_grad = subspace.gates.grad if subspace.gates is not None else None
    with torch.no_grad():
        trained = model(**batch).logits
    exported = save_materialised(model, section, str(path), work / f"{name}-peft")
    del model, base
    torch.cuda.empty_cache()
    peft_model = PeftModel.from_pretrained(load_base_model(str(path), "nf4", "cuda"), str(exported))
    with torch.no_grad():
        reloaded = peft_model(**batch).logits
    del peft_model
    torch.cuda.empty_cache()
    reference = lora_reference(path, batch)
    fields = {
        "alpha_zero_equals_base": bool(torch.equal(at_zero, base_logits)),
        "trained_differs_from_base": not bool(torch.equal(trained, base_logits)),
        "sublora_loss_first_last": [losses[0], losses[-1]],
        "sublora_loss_fell": losses[-1] < losses[0],
        "alpha_and_gates_have_gradients": has_gradient(alpha_grad) and has_gradient(gates_grad),
        "exported_peft_max_logit_difference": float((reloaded.float() - trained.float()).abs().max()),
        "sublora_step_ms_8x256": 1000 * sublora_step,
    }
    return model_row(name, "wrapped_layers", layers, fields, reference)


if __name__ == "__main__":
    run_checks(check)
