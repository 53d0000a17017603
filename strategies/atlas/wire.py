"""ATLAS's wire: the names of what its two halves send each other, and how per-layer ranks are written, read by
both (``server.py`` writes instructions and reads reports, ``client.py`` the other way round).

Instruction config (server -> client), with per-client ranks: ``lora-ranks``, the client's own LoRA rank per
layer, and ``wire-ranks``, the ranks its group's arrays travel at (the group's largest per layer); both
comma-separated in sorted layer order (``encode_ranks``). With a Laplacian step (``atlas.laplacian-eta`` > 0):
``neighbour-term``, set when the arrays sent are the client's neighbour term N_k. Report metric (client ->
server): ``memory_mb``, the client's memory budget, beside the shared fingerprint report (whose reader,
``strategies.fingerprint``, names it). The arrays are LoRA's, at the wire ranks, with the slot masks of
``common.adapters.lora.ranks`` (``MASK_PREFIX``).
"""

from __future__ import annotations

from typing import Any

from common.records import joined, metric_list

from ..fingerprint.server import MEMORY_MB

OWN_RANKS, WIRE_RANKS = "lora-ranks", "wire-ranks"  # instruction config keys: comma-separated, sorted layer order
NEIGHBOUR_TERM = "neighbour-term"  # instruction config key: the arrays sent are N_k (atlas.laplacian-eta > 0)

__all__ = ["MEMORY_MB", "NEIGHBOUR_TERM", "OWN_RANKS", "WIRE_RANKS", "decode_ranks", "encode_ranks"]


def encode_ranks(ranks: dict[str, int]) -> str:
    """Per-layer ranks as an instruction config value: comma-separated, in sorted layer order."""
    return joined(ranks[path] for path in sorted(ranks))


def decode_ranks(value: Any, paths: list[str]) -> dict[str, int]:
    """``encode_ranks``' value read back for the layers ``paths`` (ValueError when the count differs)."""
    numbers = metric_list(str(value), int)
    if len(numbers) != len(paths):
        raise ValueError(f"{len(numbers)} ranks for {len(paths)} LoRA layers")
    return dict(zip(sorted(paths), numbers))
