"""What the adapter layers that wrap a frozen projection share (PQ-LoRA's, the expert pool's): the base layer's
weight and bias seen through the wrapper, switching the adapter paths off for a block, and putting the base
layers back."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import nn


class WrappedProjection(nn.Module):
    """Base of a layer that adds an adapter path to ``base_layer`` and can be switched off (``enabled``)."""

    base_layer: nn.Module
    enabled: bool

    @property
    def weight(self):
        """The base layer's weight (some callers inspect ``module.weight``; peft's tuner layers forward it too)."""
        return self.base_layer.weight

    @property
    def bias(self):
        """The base layer's bias, or None."""
        return getattr(self.base_layer, "bias", None)


Wrapped = TypeVar("Wrapped", bound="WrappedProjection")


def wrapped_layers(
    model: nn.Module, kind: type[Wrapped], order: Callable[[Wrapped], Any], missing: str, required: bool = True
) -> list[Wrapped]:
    """``model``'s ``kind`` layers sorted by ``order``; ValueError(``missing``) if there are none and ``required``."""
    layers = sorted((m for m in model.modules() if isinstance(m, kind)), key=order)
    if required and not layers:
        raise ValueError(missing)
    return layers


def unwrap(model: nn.Module, kind: type[WrappedProjection]) -> None:
    """Every ``kind`` layer of ``model`` back to its base layer, in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, child_name, child.base_layer)


@contextmanager
def paths_disabled(layers: Sequence[WrappedProjection]) -> Iterator[None]:
    """Inside the block every layer returns its base output; each layer's flag is restored after."""
    before = [layer.enabled for layer in layers]
    try:
        for layer in layers:
            layer.enabled = False
        yield
    finally:
        for layer, flag in zip(layers, before):
            layer.enabled = flag
