"""bitsandbytes' import compiles nothing (``common.bnb_import``); its compiled helpers still compile, on first use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import ROOT

from common.bnb_import import compile_on_first_call


def test_compile_on_first_call_compiles_once_when_first_called_and_returns_the_compiled_result():
    calls = []

    def fake_compile(function, **options):
        calls.append(options)
        return lambda x: function(x) * 10

    deferred = compile_on_first_call(fake_compile)
    square = deferred(lambda x: x * x, dynamic=False)
    cube = deferred(dynamic=True)(lambda x: x**3)  # the decorator-factory form
    assert calls == []
    assert square(3) == 90 and square(2) == 40 and calls == [{"dynamic": False}]
    assert cube(2) == 80 and calls == [{"dynamic": False}, {"dynamic": True}]


def test_importing_bitsandbytes_after_common_compiles_nothing_and_its_fallback_still_computes_and_compiles():
    # A fresh interpreter: the import is what is measured. torch.compile is replaced by a counter that returns the
    # function itself (no Inductor), so the test sees when bitsandbytes asks for compilation.
    script = textwrap.dedent(
        """
        import sys
        import torch

        asked = []
        def counting_compile(function=None, **options):
            asked.append(getattr(function, "__name__", None))
            return function
        torch.compile = counting_compile

        import common
        import bitsandbytes.functional as F

        assert asked == [], asked  # nothing compiled while importing
        assert torch.compile is counting_compile  # and torch.compile is back
        assert "torch._inductor.compile_fx" not in sys.modules
        import pathlib
        import bitsandbytes
        source = bitsandbytes.__loader__.get_source("bitsandbytes")  # the rest of its loader is the real one's
        assert source == pathlib.Path(bitsandbytes.__file__).read_text()

        torch.manual_seed(0)
        weight = torch.randn(4, 33)
        packed, state = F.quantize_4bit(weight.reshape(-1), blocksize=64, quant_type="nf4")
        flat = F.dequantize_4bit(packed, state)  # an even shape: the CPU kernel
        state.shape = torch.Size([4, 33])  # an odd last dimension: bitsandbytes' compiled torch fallback
        odd = F.dequantize_4bit(packed, state)
        assert asked == ["_dequantize_4bit_compute"], asked
        assert torch.equal(odd.reshape(-1), flat.reshape(-1)), (odd.reshape(-1) - flat.reshape(-1)).abs().max()
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
