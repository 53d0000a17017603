"""SimGrad's wire: its part of a train instruction (``SimGradWire``, ``StrategySpec.wire``) and the names of its
report and reply entries, read by both ``server.py`` and ``client.py``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from common.messages import Ints, Part


class SimGradWire(Part):
    """SimGrad's key of a train instruction: the PQ-LoRA blocks a group trains and sends (layerwise routing; absent:
    every block)."""

    about: ClassVar[str] = "simgrad"
    active_blocks: Ints | None = Field(None, alias="active-blocks")


SIGNATURE = "signature"  # report array: the client's sanitised gradient signature
SALIENCE = "salience"  # report metric: the gradient norm of each PQ-LoRA block, for the routing
# train-reply metrics: the mean Procrustes error of what is sent, before and after aligning it
ALIGN_ERROR_BEFORE, ALIGN_ERROR_AFTER = "align_error_before", "align_error_after"
