"""The 4-bit path on this CPU: does evaluation change training, and what does the packed kernel buy?

    python bench/cpu_4bit_bench.py

On the real SmolLM2-135M in NF4 (fp32 compute on the CPU) with LoRA r=4 on q/v/o/down:
1. Gradient check. The LoRA gradients of one training step after an evaluation pass (no-grad forward + greedy
   generation, eval mode) against a fresh model's on the same batch, max relative difference, for
   ``bitsandbytes`` (its own in-place packing, what ran before ``common.bnb_cpu``) and ``tessera`` (ours).
   Where the CPU lacks AVX512-BF16 the packed kernel is emulated in torch (``emulated_packed_kernel``), which
   reproduces the layout switch, not the speed.
2. Speed, only with the real kernel: a no-grad forward of 8 x 160 tokens and greedy generation of 16 tokens for
   8 prompts, packed (bf16 kernel) vs unpacked (``cpu_packed_inference=False``: since 2026-11-28 the fp32
   dequantised copy, as on CPUs without the kernel; before, bitsandbytes' own 4-bit gemm), the one-off packing
   cost and the memory of the packed copies.
3. Training step, on every CPU: one forward and backward of LoRA on 2 x 160 tokens through bitsandbytes' own 4-bit
   path (dequantising each weight on the forward and again on the backward) against the dequantised copy (since
   2026-11-29, what every CPU forward of a layer without the packed kernel uses), steps alternated on the same model
   (median seconds of 6 each), and whether the loss and gradients are identical.
4. Decoding's matmuls, on every CPU: a greedy token at 8 rows multiplies by every dequantised weight (the model's
   210 layers and its tied head). ``F.linear`` (MKL, what evaluation runs) against oneDNN's inner product on weights
   packed once (``torch.ops.mkldnn._reorder_linear_weight``), best of 5 ms, and their max relative difference; the
   seconds to read the layers' bytes once (``sum``) as this machine's bandwidth for comparison.
Writes ``bench/results/cpu_4bit.json`` and prints it.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common import bnb_cpu
from common.adapters import attach_lora
from common.adapters.lora import LoraSection
from common.config import DataSection
from common.data import client_data
from common.model import load_base_model, load_tokenizer
from common.training import collate, encode

MODEL = "smollm2-135m-instruct"


def batch(tokenizer, n: int = 8, max_len: int = 160) -> dict[str, torch.Tensor]:
    train, _ = client_data(DataSection(tasks=["boolq", "asdiv"]), 0, 1, seed=0)
    return collate([encode(tokenizer, e, max_len) for e in train[:n]], tokenizer.pad_token_id)


def lora_model(packed: bool, bitsandbytes_default: bool):
    model = load_base_model(MODEL, "nf4", "cpu", cpu_packed_inference=packed)
    if bitsandbytes_default:  # undo common.bnb_cpu: bitsandbytes repacks in place, as it does by itself
        import bitsandbytes as bnb

        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.__class__ = bnb.nn.Linear4bit
                m.support_avx512bf16_for_cpu = True
    return attach_lora(model, LoraSection(r=4, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]), seed=0)


def lora_grads(model, data) -> dict[str, torch.Tensor]:
    model.train()
    model(**data).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def evaluate_once(model, data) -> None:
    model.eval()
    with torch.no_grad():
        model(input_ids=data["input_ids"], attention_mask=data["attention_mask"])
        model.generate(input_ids=data["input_ids"][:2, :24], max_new_tokens=2, do_sample=False, pad_token_id=0)


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def gradient_check(data) -> dict[str, float | str]:
    fresh = lora_grads(lora_model(packed=True, bitsandbytes_default=False), data)
    out: dict[str, float | str] = {}
    for label, default in (("bitsandbytes", True), ("tessera", False)):
        model = lora_model(packed=True, bitsandbytes_default=default)
        evaluate_once(model, data)
        try:
            out[label] = max_relative_difference(lora_grads(model, data), fresh)
        except RuntimeError as err:  # what bitsandbytes' layout can also do: fail outright
            out[label] = f"error: {err}"[:200]
    return out


def timed(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def speed(data, tokenizer) -> dict[str, float]:
    inputs = {k: data[k] for k in ("input_ids", "attention_mask")}
    prompts = data["input_ids"][:, :64]
    out: dict[str, float] = {}
    for packed in (False, True):
        model = load_base_model(MODEL, "nf4", "cpu", cpu_packed_inference=packed).eval()
        label = "packed" if packed else "unpacked"

        def forward(m=model):
            m(**inputs)

        def generate(m=model):
            m.generate(input_ids=prompts, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)

        with torch.no_grad():
            start = time.perf_counter()
            model(input_ids=data["input_ids"][:1, :8])
            out[f"{label}_first_forward_s"] = time.perf_counter() - start  # includes packing every layer once
            out[f"{label}_forward_8x160_s"] = timed(forward)
            out[f"{label}_generate_8x16_s"] = timed(generate, 1)
        if packed:
            copies = [m.__dict__["_packed"] for m in model.modules() if "_packed" in m.__dict__]
            out["packed_copy_mb"] = sum(d.numel() + s.absmax.numel() * 2 for _, d, s in copies) / 2**20
    return out


def training_step(data, steps: int = 6) -> dict[str, float | bool]:
    model = lora_model(packed=False, bitsandbytes_default=False)  # every layer on the dequantised copy
    layers = [m for m in model.modules() if isinstance(m, bnb_cpu.PackedInferenceLinear4bit)]
    two = {k: v[:2] for k, v in data.items()}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    grads: dict[bool, dict[str, torch.Tensor]] = {}
    for _ in range(steps):
        for dequantised in (False, True):
            for m in layers:
                m.dequantised = dequantised
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            grads[dequantised] = lora_grads(model, two)
            seconds[dequantised].append(time.perf_counter() - start)
    median = {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}
    return {
        "bitsandbytes_step_s": median[False],
        "dequantised_copy_step_s": median[True],
        "speedup": median[False] / median[True],
        "identical_gradients": all(torch.equal(grads[True][n], g) for n, g in grads[False].items()),
    }


def decode_matmuls(rows: int = 8) -> dict[str, float]:
    model = load_base_model(MODEL, "nf4", "cpu", cpu_packed_inference=False).eval()
    layers = [m for m in model.modules() if isinstance(m, bnb_cpu.PackedInferenceLinear4bit)]
    weights = [m.dequantised_weight(torch.float32) for m in layers]
    head = model.get_output_embeddings().weight.detach()
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights + [head]}}
    out: dict[str, float] = {"layers": len(weights), "layer_mb": sum(w.numel() for w in weights) * 4 / 2**20}
    with torch.no_grad():
        for name, group in (("layers", weights), ("head", [head])):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in group]

            def plain(ws=group):
                return [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in ws]

            def onednn(ws=group, ps=packed):
                return [
                    torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(ws, ps)
                ]

            out[f"{name}_f_linear_ms"] = timed(plain, 5) * 1e3
            out[f"{name}_onednn_packed_ms"] = timed(onednn, 5) * 1e3
            out[f"{name}_max_relative_difference"] = max_relative_difference(
                {str(i): t for i, t in enumerate(onednn())}, {str(i): t for i, t in enumerate(plain())}
            )
        flat = torch.cat([w.flatten() for w in weights])
        out["read_layers_once_ms"] = timed(flat.sum, 5) * 1e3
    return out


def main() -> None:
    torch.manual_seed(0)
    tokenizer = load_tokenizer(MODEL)
    data = batch(tokenizer)
    native = bnb_cpu.cpu_kernel_available()
    result = {
        "machine": platform.processor() or platform.machine(),
        "avx512_bf16": native,
        "threads": torch.get_num_threads(),
    }
    with nullcontext() if native else bnb_cpu.emulated_packed_kernel():
        result["max_relative_gradient_difference_after_eval"] = gradient_check(data)
    result["speed"] = speed(data, tokenizer) if native else "no AVX512-BF16 here: only the unpacked path exists"
    result["training_step"] = training_step(data)
    result["decode_matmuls"] = decode_matmuls()
    out = Path(__file__).parent / "results" / "cpu_4bit.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
