"""ATLAS's wire: its part of an instruction (``AtlasWire``, ``StrategySpec.wire``) and its report metric, read by
both halves (``server.py`` writes instructions and reads reports, ``client.py`` the other way round).

With per-client ranks an instruction carries ``lora-ranks``, the client's own LoRA rank per layer, and
``wire-ranks``, the ranks its group's arrays travel at (the group's largest per layer), both in sorted layer order;
with a Laplacian step (``atlas.laplacian-eta`` > 0), ``neighbour-term``, set when the arrays sent are the client's
neighbour term N_k. Report metric (client -> server): ``memory_mb``, the client's memory budget, beside the shared
fingerprint report (whose reader, ``strategies.fingerprint``, names it). The arrays are LoRA's, at the wire ranks,
with the slot masks of ``common.adapters.lora.ranks`` (``MASK_PREFIX``).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from common.messages import Ints, Part

from ..fingerprint.server import MEMORY_MB

__all__ = ["MEMORY_MB", "AtlasWire", "by_layer", "in_layer_order"]


class AtlasWire(Part):
    """ATLAS's keys of a train or evaluate instruction (every one optional: a run without ranks sends none)."""

    about: ClassVar[str] = "atlas"
    own_ranks: Ints | None = Field(None, alias="lora-ranks")
    wire_ranks: Ints | None = Field(None, alias="wire-ranks")
    neighbour_term: bool | None = Field(None, alias="neighbour-term")


def in_layer_order(ranks: dict[str, int]) -> tuple[int, ...]:
    """Per-layer ranks as they travel: in sorted layer order."""
    return tuple(ranks[path] for path in sorted(ranks))


def by_layer(ranks: tuple[int, ...], paths: list[str]) -> dict[str, int]:
    """``in_layer_order``'s ranks read back for the layers ``paths`` (ValueError when the count differs)."""
    if len(ranks) != len(paths):
        raise ValueError(f"{len(ranks)} ranks for {len(paths)} LoRA layers")
    return dict(zip(sorted(paths), ranks))
