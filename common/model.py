"""Loading a base LLM: a built-in offline alias, a local directory, a GGUF file or a Hugging Face model id.

Quantisation is 4-bit NF4 through bitsandbytes (CUDA and CPU), or plain bf16 / fp32 when asked. The base weights
are frozen; adapters are attached afterwards (see ``common.adapters``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .assets import QWEN_CODER_ALIAS, SMOLLM2_ALIAS, gguf_checkpoint, qwen_coder_checkpoint, smollm2_checkpoint

log = logging.getLogger(__name__)

BUILTIN_MODELS = {SMOLLM2_ALIAS: smollm2_checkpoint, QWEN_CODER_ALIAS: qwen_coder_checkpoint}


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_model(name: str) -> str:
    """Map a model setting to what ``from_pretrained`` takes: a checkpoint directory or an HF model id.

    A GGUF file is dequantised once into a cached checkpoint (so it can then be re-quantised to NF4).
    """
    if name in BUILTIN_MODELS:
        return str(BUILTIN_MODELS[name]())
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"model.name: GGUF file {path} does not exist")
        return str(gguf_checkpoint(path))
    if path.exists():
        return str(path)
    return name  # a Hugging Face model id; needs a reachable hub


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(
    name: str,
    quantization: str = "nf4",
    device: str = "auto",
    cpu_packed_inference: bool = False,
    gradient_checkpointing: bool = False,
):
    """Load a causal LM with frozen weights, quantised as asked.

    Args:
        name: built-in alias, local checkpoint directory, ``*.gguf`` file or HF model id.
        quantization: ``nf4`` (bitsandbytes 4-bit, double quantisation; bf16 compute on CUDA, fp32 on CPU),
            ``bf16`` or ``fp32``.
        device: ``auto``, ``cpu`` or ``cuda``.
        cpu_packed_inference: NF4 on a CPU with AVX512-BF16: no-grad eval forwards (evaluation, generation,
            probes) use bitsandbytes' packed bf16 kernel on a copy of the weights; training uses the normal layout
            (``common.bnb_cpu``). False (the default), and on other CPUs: every CPU forward, training included, in
            fp32 from a dequantised copy: the same numbers on every CPU, bit for bit bitsandbytes' own. No effect
            on CUDA.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass instead of keeping
            them (transformers' non-reentrant checkpointing): activation memory of about one layer instead of all,
            for roughly one more forward's compute. Off by default: a small model on a CPU is compute-bound.
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    source = resolve_model(name)
    device = pick_device(device)
    kwargs: dict = {"device_map": device}
    # bf16 matmuls are fast on GPUs but 5-6x SLOWER than fp32 on CPUs without AVX512-BF16 (measured: 47 s vs
    # 8 s for one 8x200-token forward of SmolLM2-135M on 2 cores), so compute in fp32 on the CPU.
    compute_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if quantization == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=True,
        )
        kwargs["dtype"] = compute_dtype
    else:
        kwargs["dtype"] = {"bf16": torch.bfloat16, "fp32": torch.float32}[quantization]
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    for param in model.parameters():
        param.requires_grad_(False)
    checkpointing = {"use_reentrant": False}  # works with frozen inputs and adapters that wrap layers
    if quantization == "nf4":
        # Norms in fp32 for stable training on top of 4-bit weights.
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing, gradient_checkpointing_kwargs=checkpointing
        )
        # Before any forward: bitsandbytes would otherwise repack weights in place on AVX512-BF16 CPUs at the
        # first no-grad eval forward and train on its inference kernel from then on (wrong gradients).
        from .bnb_cpu import use_packed_inference

        use_packed_inference(model, enabled=None if cpu_packed_inference else False)
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    # Padding-free rows (train.packing) attend per example; everything else is SDPA as before (common.attention).
    from .attention import use_segment_attention

    use_segment_attention(model)
    model.config.use_cache = False
    return model
