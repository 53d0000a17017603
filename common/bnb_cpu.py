"""bitsandbytes 4-bit layers on the CPU: one place for the machine-dependent fast path.

On a CPU with AVX512-BF16, bitsandbytes (0.50) converts a ``Linear4bit`` weight IN PLACE to a CPU-packed layout
the first time the module runs in eval mode on an input that does not require grad, and from then on every
forward of that module, training included, goes through the inference kernel ``gemv_4bit``: bf16 math and no
autograd. On those machines a model that evaluated once (HF models leave ``from_pretrained`` in eval mode; our
evaluation, generation and signature probes run without grad) trains on wrong gradients, silently; layers
narrower than the quantisation block crash in the conversion; and bitsandbytes' inverse conversion is lossy (it
re-quantises the double-quantised absmax from bf16). On other CPUs nothing of this happens, so the same code
trained differently depending on the machine.

What we do instead, for every ``Linear4bit`` of a model (``use_packed_inference``):
- bitsandbytes' in-place conversion is switched off, so the training layout is never touched;
- the layer becomes a :class:`PackedInferenceLinear4bit`: under ``torch.no_grad()`` / ``inference_mode`` in eval
  mode on the CPU (evaluation, ``generate``, no-grad probes), it uses a packed COPY of its weight with the fast
  kernel, built on first use and kept; any forward that may need a gradient (train mode, or grad enabled) uses
  the original weight and bitsandbytes' normal, differentiable path. Nothing is switched back and forth, so the
  gradients are those of a model that never evaluated, whoever trains it (our loop, peft's, a user's).
- where the packed kernel is missing or packing is off (``model.cpu-packed-inference=false``, the default since
  2026-11-29: measured faster even where the kernel exists, docs/cpu-4bit.md), every CPU forward, training included,
  uses a dequantised copy of the weight: the dense matmul bitsandbytes' own CPU path computes after dequantising
  on every call, so the same numbers bit for bit, with each weight dequantised once instead of twice a step.
Cost of the packed path: one extra copy of the packed 4-bit weights per model (about the model's 4-bit size); it
computes in bf16, so evaluation numbers match the fp32 path to bf16 precision. Measured on such a machine
(``bench/cpu_4bit_bench.py``, docs/cpu-4bit.md) it is slower than the dequantised copy, hence off by default.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import bitsandbytes as bnb
import torch
from bitsandbytes.functional import (
    QuantState,
    _convert_weight_packed_for_cpu,
    _convert_weight_packed_for_cpu_inverse,
    dequantize_4bit,
    has_avx512bf16,
)
from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

log = logging.getLogger(__name__)

# The layout bitsandbytes' CPU kernel reads: output rows in tiles of 32, two 4-bit codes per byte.
_PACK_TILE = 32


# Set only inside ``emulated_packed_kernel``.
_emulation = {"on": False}


def cpu_kernel_available() -> bool:
    """Whether bitsandbytes has its packed 4-bit CPU kernel on this machine (it needs AVX512-BF16)."""
    return _emulation["on"] or bool(has_avx512bf16())


def packable(layer: bnb.nn.Linear4bit) -> bool:
    """Whether the CPU-packed layout exists for this layer's shape (out rows in tiles of 32, whole blocks in a row).

    Narrower layers (e.g. a tiny test model's 32-wide projections with 64-wide quantisation blocks) crash in
    bitsandbytes' conversion; they simply stay on the normal path.
    """
    state = getattr(layer.weight, "quant_state", None)
    if state is None or len(state.shape) != 2:
        return False
    rows, cols = int(state.shape[0]), int(state.shape[1])
    return rows % _PACK_TILE == 0 and cols % 2 == 0 and cols % int(state.blocksize) == 0


class PackedInferenceLinear4bit(bnb.nn.Linear4bit):
    """A bitsandbytes ``Linear4bit`` whose forwards on the CPU use a copy of its weight.

    The weight and its ``quant_state`` keep the layout that training, saving and ``.to(device)`` expect; the copy
    lives beside them, outside the state dict, built on first use. ``packed_inference``: for no-grad eval forwards
    only, the packed layout (bf16 absmax, tiles of 32 rows) for bitsandbytes' AVX512-BF16 kernel; training forwards
    take bitsandbytes' normal path. ``dequantised`` (CPUs without that kernel, layers that do not fit it, or packing
    off): EVERY forward on the CPU, training included, is one dense matmul with the weight dequantised once to the
    compute dtype. bitsandbytes' own 4-bit CPU path computes the same dense matmul (``gemm_4bit``'s default: dequantise,
    then ``linear``; its backward: dequantise again, then ``grad @ W``), so losses and gradients are bit for bit the
    same (``tests/test_bnb_cpu.py``), without two dequantisations of every weight per training step or the one per
    call that makes its no-grad forwards about 3x slower for SmolLM2-135M on 2 cores (generation calls it once per
    token). The weight stays frozen: the copy never requires grad. Memory: 4 bytes per weight. Both off (set by
    :func:`use_packed_inference`): every forward takes the normal path.
    """

    packed_inference: bool = False
    dequantised: bool = False

    def uses_copy(self, x: torch.Tensor) -> bool:
        """Whether this forward runs on a copy: on the CPU, the dequantised copy always, the packed copy only when
        the forward cannot need a gradient (eval mode, grad disabled)."""
        if x.device.type != "cpu" or self.weight.device.type != "cpu":
            return False
        return self.dequantised or (self.packed_inference and not self.training and not torch.is_grad_enabled())

    def packed_weight(self) -> tuple[torch.Tensor, QuantState]:
        """The packed copy of the weight and its quant state (rebuilt if the weight's storage was replaced)."""
        weight = cast(bnb.nn.Params4bit, self.weight)
        source = (weight.data_ptr(), id(weight.quant_state))
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] != source:
            # The conversion rewrites the quant state it is given (absmax, nesting): convert a copy.
            data, state = _convert_weight_packed_for_cpu(weight.data, copy.deepcopy(weight.quant_state))
            cached = (source, data, state)
            self.__dict__["_packed"] = cached
        return cached[1], cached[2]

    def dequantised_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantised to ``dtype`` (rebuilt if the weight's storage or dtype changed)."""
        weight = cast(bnb.nn.Params4bit, self.weight)
        source = (weight.data_ptr(), id(weight.quant_state), dtype)
        cached = self.__dict__.get("_dequantised")
        if cached is None or cached[0] != source:
            dense = dequantize_4bit(weight.data, weight.quant_state).to(dtype)
            cached = (source, dense)
            self.__dict__["_dequantised"] = cached
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_copy(x):
            return super().forward(x)
        fix_4bit_weight_quant_state_from_module(self)
        if not self.compute_type_is_set:
            self.set_compute_type(x)
            self.compute_type_is_set = True
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.dequantised:  # a plain dense matmul, differentiable in x
            return torch.nn.functional.linear(x, self.dequantised_weight(x.dtype), bias).to(inp_dtype)
        data, state = self.packed_weight()
        # ``matmul_4bit`` sees the packing flag on the state and calls the CPU kernel (bf16 inside).
        return bnb.matmul_4bit(x, data, bias=bias, quant_state=state).to(inp_dtype)


def use_packed_inference(model: torch.nn.Module, enabled: bool | None = None) -> dict[str, int]:
    """Make every bitsandbytes ``Linear4bit`` of ``model`` train on its own layout and infer packed where it can.

    Args:
        model: any module; only its ``Linear4bit`` layers change (in place).
        enabled: no-grad eval forwards use the packed kernel's layout (bf16 math) where the CPU has it
            (:func:`cpu_kernel_available`) and the layer fits it, else the dequantised weight (fp32 math, the same
            numbers as bitsandbytes' own 4-bit CPU path); ``None`` = the same. ``False``: the dequantised weight on
            every CPU, so that evaluation computes the same numbers whatever the CPU (comparisons use this).

    Returns counts: ``layers`` (4-bit layers seen), ``packed`` (those that will infer packed) and ``dequantised``
    (those whose every CPU forward, training too, will use a dequantised copy).
    A layer bitsandbytes already converted in place is converted back first, with a warning (its inverse is
    lossy), so that even a model that evaluated before this call trains on the normal path from then on.
    """
    enabled = enabled is not False
    kernel = cpu_kernel_available()
    seen = packed = dequantised = 0
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        seen += 1
        weight = cast(bnb.nn.Params4bit, module.weight)
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            log.warning("%s: bitsandbytes had packed this layer in place; converting it back", name)
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
        module.support_avx512bf16_for_cpu = False  # bitsandbytes' own in-place conversion: never
        if type(module) is bnb.nn.Linear4bit:
            module.__class__ = PackedInferenceLinear4bit
        if isinstance(module, PackedInferenceLinear4bit):
            module.packed_inference = enabled and kernel and packable(module)
            module.dequantised = not module.packed_inference
            module.__dict__.pop("_packed", None)
            module.__dict__.pop("_dequantised", None)
            packed += module.packed_inference
            dequantised += module.dequantised
    return {"layers": seen, "packed": packed, "dequantised": dequantised}


def reference_packed_gemv(
    a: torch.Tensor, b: torch.Tensor, shape_b: Sequence[int], absmax: torch.Tensor, code: torch.Tensor, blocksize: int
) -> torch.Tensor:
    """What bitsandbytes' AVX512-BF16 kernel computes, in plain torch: ``a @ W.T`` in bf16 from the packed layout.

    ``b`` is [N, K/2] bytes as ``_convert_weight_packed_for_cpu`` lays them out (rows in tiles of 32; each run of
    32 bytes holds 64 codes, the first 32 in the low nibbles, the next 32 in the high ones); ``absmax`` is
    [K / blocksize, N] bf16. Slow; for tests and benchmarks on CPUs without the kernel.
    """
    rows, cols = int(shape_b[0]), int(shape_b[1])
    packed = b.view(torch.uint8).reshape(-1, _PACK_TILE)
    nibbles = torch.cat([packed & 0xF, packed >> 4], dim=-1)
    codes = nibbles.reshape(rows // _PACK_TILE, cols // 2, _PACK_TILE, 2).transpose(1, 2).reshape(rows, cols)
    scales = absmax.float().T.repeat_interleave(blocksize, dim=1)
    weight = (code.float()[codes.long()] * scales).to(torch.bfloat16)
    return (a.to(torch.bfloat16).float() @ weight.float().T).to(torch.bfloat16)


@contextmanager
def emulated_packed_kernel() -> Iterator[dict[str, int]]:
    """On a CPU without the kernel: register :func:`reference_packed_gemv` as bitsandbytes' packed CPU kernel and
    report the CPU as capable, so the packed path runs here too (yields a call counter). For tests and benchmarks."""
    if cpu_kernel_available():
        raise RuntimeError("this CPU has the real packed kernel (or emulation is on already)")
    calls = {"n": 0}

    def counted(*args):
        calls["n"] += 1
        return reference_packed_gemv(*args)

    lib = torch.library.Library("bitsandbytes", "IMPL")
    lib.impl("gemv_4bit", counted, "CPU")
    _emulation["on"] = True
    try:
        yield calls
    finally:
        _emulation["on"] = False
        lib._destroy()
