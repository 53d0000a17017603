"""The total weight Flower's SecAgg+ unmasks, recorded so that the server can check it (``masked_weight_problem``).

``SecAggPlusWorkflow`` unmasks the members' summed weights together with their summed update and divides one by the
other without exposing the sum. It reads that sum with ``factor_extract``; ``record_unmasked_weight`` wraps that
one call in the workflow's module, and keeps the value per thread, because the groups of a round run their
workflows concurrently, one thread each (``transport.train_groups_secure``). ``tests/test_secagg.py`` fails if a
Flower upgrade stops calling it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flwr.server.workflow.secure_aggregation import secaggplus_workflow

_recorded = threading.local()
_factor_extract = secaggplus_workflow.factor_extract


def _recording_factor_extract(parameters: Any) -> tuple[int, Any]:
    factor, rest = _factor_extract(parameters)
    if getattr(_recorded, "box", None) is not None:
        _recorded.box.append(int(factor))
    return factor, rest


secaggplus_workflow.factor_extract = _recording_factor_extract


@contextmanager
def record_unmasked_weight() -> Iterator[list[int]]:
    """Within the block, the SecAgg+ workflow run by this thread appends its unmasked total weight to the list."""
    box: list[int] = []
    _recorded.box = box
    try:
        yield box
    finally:
        _recorded.box = None
