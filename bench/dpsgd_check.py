"""Record-level DP-SGD on a client: does Opacus run on the LoRA of the 4-bit model, and what does a step cost?

    pip install "opacus>=1.6.0"    # not a dependency of Tessera
    python -m bench.dpsgd_check [--steps 4] [--batch 4] [--out bench/results/dpsgd.json]

Loads the real SmolLM2 in NF4 (bitsandbytes) with peft's LoRA (the defaults: r 8 on q_proj, v_proj), checks it with
Opacus's ``ModuleValidator``, takes ``--steps`` plain SGD steps and then the same number of DP-SGD steps (Opacus's
``PrivacyEngine``: per-example gradients by hooks, each clipped to norm 1, noise multiplier 1) on the same
batches, and writes the seconds per step, the losses and the epsilon Opacus's RDP accountant reports (delta 1e-5;
no sampling amplification: ``poisson_sampling=False``). A failure of Opacus on these layers is written with its
error. Not wired into the client yet (docs/privacy.md).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any


def _steps(model, optimizer, loader) -> dict[str, list[float]]:
    seconds, losses = [], []
    for ids, mask, labels in loader:
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
        losses.append(float(loss))
    return {"seconds_per_step": seconds, "loss": losses}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default="bench/results/dpsgd.json")
    args = parser.parse_args(argv)
    import torch

    from common.adapters.lora.config import LoraSection
    from common.adapters.lora.model import attach_lora
    from common.model import load_base_model, load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model)
    model = attach_lora(load_base_model(args.model, "nf4", "cpu", cpu_packed_inference=False), LoraSection())
    model.train()
    texts = [f"Question {i}: what is seven times {i}? Answer: {7 * i}." for i in range(args.steps * args.batch)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    labels = encoded["input_ids"].clone()
    labels[encoded["attention_mask"] == 0] = -100
    data = torch.utils.data.TensorDataset(encoded["input_ids"], encoded["attention_mask"], labels)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    params = [p for p in model.parameters() if p.requires_grad]
    result: dict[str, Any] = {
        "model": args.model,
        "batch": args.batch,
        "sequence_length": int(encoded["input_ids"].shape[1]),
        "trainable_parameters": sum(p.numel() for p in params),
        "plain": _steps(model, torch.optim.SGD(params, lr=1e-3), loader),
    }
    try:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        result["validator_errors"] = [str(e) for e in ModuleValidator.validate(model, strict=False)]
        engine = PrivacyEngine(accountant="rdp")
        private, optimizer, private_loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(params, lr=1e-3),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="hooks",
            poisson_sampling=False,
        )
        result["dp_sgd"] = _steps(private, optimizer, private_loader)
        result["dp_epsilon_at_delta_1e-5"] = engine.get_epsilon(1e-5)
    except Exception as err:  # the finding is the error itself
        result["dp_sgd_error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc(limit=5)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, indent=1))
    return result


if __name__ == "__main__":
    main()
