"""SimGrad's wire keys: the names of what its two halves send each other, read by both ``server.py`` and
``client.py``, and how a group's routed blocks are written in its train instruction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.records import joined, metric_list

# train-instruction config: the PQ-LoRA blocks a group trains and sends (layerwise routing), comma-joined
ACTIVE_BLOCKS = "active-blocks"
SIGNATURE = "signature"  # report array: the client's sanitised gradient signature
SALIENCE = "salience"  # report metric: the gradient norm of each PQ-LoRA block, for the routing
# train-reply metrics: the mean Procrustes error of what is sent, before and after aligning it
ALIGN_ERROR_BEFORE, ALIGN_ERROR_AFTER = "align_error_before", "align_error_after"


def blocks_config(blocks: list[int]) -> dict[str, str]:
    """A group's train-instruction config for its routed ``blocks``."""
    return {ACTIVE_BLOCKS: joined(blocks)}


def active_blocks(config: Mapping[str, Any]) -> list[int] | None:
    """The routed blocks of a train instruction's config (None: no routing, every block)."""
    blocks = metric_list(str(config.get(ACTIVE_BLOCKS, "")), int)
    return blocks or None
