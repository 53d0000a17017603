"""bitsandbytes imported without compiling anything at import time.

bitsandbytes (0.50) wraps four pure-torch helpers in ``torch.compile`` while it is imported
(``backends/default/ops.py``: the 4-bit and blockwise dequantisation fallbacks for shapes its kernels do not take,
and the 32-bit optimizer steps). Building those wrappers imports TorchDynamo's compiler and Inductor: about 1.4 s of
CPU in every process that imports bitsandbytes (peft does), measured on 2 cores, before the process does any work.
Every ClientApp process, SuperNode worker and Ray actor pays it. None of the four runs for our models (the CPU and
CUDA kernels take their shapes; we train with torch's optimizers), and where one does, it should still be compiled.

So bitsandbytes is imported with ``torch.compile`` standing in for a wrapper that compiles on the first CALL
(``compile_on_first_call``); ``torch.compile`` itself is back as soon as bitsandbytes' import has run. Installed by
``common/__init__.py``, before any peft or bitsandbytes import of ours (only ``common.bnb_cpu`` imports bitsandbytes
at module level; peft is imported inside functions). Checked on SmolLM2 in NF4 on the CPU: loading, a LoRA training
step and ``generate`` ask ``torch.compile`` for nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

PACKAGE = "bitsandbytes"


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``torch.compile`` (``compile_fn``) that returns, for a function, a wrapper calling
    ``compile_fn(function, **options)`` once, on its first call, and the compiled function from then on."""

    def deferred(model: Callable[..., Any] | None = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda function: deferred(function, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_fn(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    return deferred


class _DeferringLoader(importlib.abc.Loader):
    """Runs the real loader of ``bitsandbytes/__init__.py`` with ``torch.compile`` deferred."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        real = torch.compile
        torch.compile = compile_on_first_call(real)
        try:
            self.loader.exec_module(module)  # bitsandbytes' submodules are imported in here too
        finally:
            torch.compile = real


class _BitsandbytesFinder(importlib.abc.MetaPathFinder):
    """Finds ``bitsandbytes`` as the other finders would, and gives it the deferring loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


def defer_bitsandbytes_compile() -> None:
    """Install the finder (once); nothing to do where bitsandbytes is already imported."""
    if PACKAGE in sys.modules or any(isinstance(finder, _BitsandbytesFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _BitsandbytesFinder())
