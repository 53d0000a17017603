"""What the adapter layers that wrap a frozen projection share (PQ-LoRA's, the expert pool's): the base layer's
weight and bias seen through the wrapper, switching the adapter paths off for a block, and putting the base
layers back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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
