"""ATLAS's client half: the fingerprint report (shared with MIRA) with the client's memory budget, and its own
per-layer LoRA ranks.

When the server has allocated ranks, an instruction's config carries the client's ranks (``lora-ranks``) and the
ranks its group's arrays travel at (``wire-ranks``, the group's largest per layer; SecAgg+ sums one shape). The
client attaches a LoRA of its own ranks (peft ``rank_pattern``, the scale alpha / r kept), takes its slots of what
arrives, and sends its trained slots zero-padded to the wire ranks with a slot mask per layer, so the server can
average every slot over the members that have it (``strategies.atlas.ranks.slot_average``).

With ``atlas.laplacian-eta > 0`` the client keeps its own trained adapter in node state, as a MIRA client does,
and what arrives flagged ``neighbour-term`` is its same-cluster neighbours' term N_k: it starts from
(1 - eta) W_k + eta N_k, and saves its own adapter at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from common.adapters.lora import LoraSection
from common.adapters.lora import ranks as lora_ranks
from common.messages import Part

from ..base import Arrays
from ..client import ClientRuntime, save_whole_adapter
from ..fingerprint import FingerprintClient
from ..fingerprint.laplacian import laplacian_start
from .config import AtlasSection
from .wire import MEMORY_MB, AtlasWire, by_layer

if TYPE_CHECKING:
    from common.adapters import ClientState

OWN_ADAPTER = "atlas.adapter"  # node state: the client's own trained adapter (atlas.laplacian-eta > 0)


class AtlasClient(FingerprintClient):
    """ATLAS on a client (see the module docstring)."""

    state_keys: ClassVar[tuple[str, ...]] = (*FingerprintClient.state_keys, OWN_ADAPTER)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.own: dict[str, int] | None = None
        self.wire: dict[str, int] | None = None
        self.eta = cfg.section(AtlasSection).laplacian_eta
        self.neighbour_term = False

    def report(self, rt: ClientRuntime, state: ClientState, server_round: int) -> tuple[Arrays, dict[str, Any]]:
        rt.reattach(self.cfg)  # fingerprints at the run's initial adapter, whatever ranks were attached last
        arrays, metrics = super().report(rt, state, server_round)
        budget = self.cfg.section(AtlasSection).budget(rt.partition_id, rt.node_config)
        if budget is not None:
            metrics[MEMORY_MB] = budget
        return arrays, metrics

    def configure(self, rt: ClientRuntime, wire: Part | None) -> None:
        part = wire if isinstance(wire, AtlasWire) else AtlasWire()
        self.neighbour_term = bool(part.neighbour_term)
        if part.own_ranks is None:
            self.own = self.wire = None
            rt.reattach(self.cfg)
            return
        if part.wire_ranks is None:
            raise ValueError("atlas: an instruction with lora-ranks carries no wire-ranks")
        paths = list(lora_ranks.layers(rt.adapter.initial))
        self.own = by_layer(part.own_ranks, paths)
        self.wire = by_layer(part.wire_ranks, paths)
        lora = self.cfg.section(LoraSection)
        rt.reattach(self.cfg.with_section(lora.model_copy(update={"rank_pattern": self.own})))

    def wire_reference(self, rt: ClientRuntime, wire: Part | None) -> Arrays:
        if self.own is None or self.wire is None:
            return rt.adapter.initial
        return {**lora_ranks.resize(rt.adapter.initial, self.wire), **lora_ranks.masks(self.own, self.wire)}

    def start(self, rt: ClientRuntime, received: Arrays | None) -> Arrays | None:
        """This client's slots of the group's adapter (with a Laplacian step: of the neighbour term, mixed into its
        own adapter, which follows its current ranks)."""
        if received is not None and self.own is not None:
            received = lora_ranks.resize(lora_ranks.without_masks(received), self.own)
        if not self.eta:
            return received
        own = rt.state.get(OWN_ADAPTER)
        if own is not None and self.own is not None:
            own = lora_ranks.resize(own, self.own)
        return laplacian_start(own, received, rt.adapter.initial, self.eta, self.neighbour_term)

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """The trained slots zero-padded to the wire ranks, with this client's slot masks (and, with a Laplacian
        step, the trained adapter kept as the client's own)."""
        if self.eta:
            rt.state.put(OWN_ADAPTER, arrays)
        if self.own is None or self.wire is None:
            return arrays, {}
        return {**lora_ranks.resize(arrays, self.wire), **lora_ranks.masks(self.own, self.wire)}, {}

    def save(self, rt: ClientRuntime, out_dir: Path) -> Path | None:
        """With a Laplacian step the client's stepped adapter is its only copy (PEFT directory); otherwise the
        server saves each cluster's."""
        return save_whole_adapter(rt, out_dir) if self.eta else super().save(rt, out_dir)
