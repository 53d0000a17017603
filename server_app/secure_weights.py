"""What Flower's SecAgg+ unmasks, recorded so that the server can check it (``server_app.secure``).

``SecAggPlusWorkflow`` unmasks the members' summed weights together with their summed (quantised) update, then
dequantises and divides one by the other without exposing either. It reads them with ``factor_extract``;
``record_unmasked`` wraps that one call in the workflow's module and keeps the values per thread, because the
groups of a round run their workflows concurrently, one thread each (``secure.train_groups_secure``).
``tests/test_secagg.py`` fails if a Flower upgrade stops calling it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.server.workflow.secure_aggregation import secaggplus_workflow

_recorded = threading.local()
_factor_extract = secaggplus_workflow.factor_extract


@dataclass
class Unmasked:
    """One workflow's unmasked values: the total quantised weight and the integer sums (before dequantisation)."""

    weights: list[int] = field(default_factory=list)
    sums: list[list[np.ndarray]] = field(default_factory=list)


def _recording_factor_extract(parameters: Any) -> tuple[int, Any]:
    factor, rest = _factor_extract(parameters)
    box = getattr(_recorded, "box", None)
    if box is not None:
        box.weights.append(int(factor))
        box.sums.append([np.array(a, copy=True) for a in rest])
    return factor, rest


secaggplus_workflow.factor_extract = _recording_factor_extract


@contextmanager
def record_unmasked() -> Iterator[Unmasked]:
    """Within the block, the SecAgg+ workflow run by this thread records what it unmasks."""
    box = Unmasked()
    _recorded.box = box
    try:
        yield box
    finally:
        _recorded.box = None
