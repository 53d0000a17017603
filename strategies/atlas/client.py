"""ATLAS's client half: the fingerprint report (shared with MIRA) with the client's memory budget, and its own
per-layer LoRA ranks.

When the server has allocated ranks, an instruction's config carries the client's ranks (``lora-ranks``) and the
ranks its group's arrays travel at (``wire-ranks``, the group's largest per layer; SecAgg+ sums one shape). The
client attaches a LoRA of its own ranks (peft ``rank_pattern``, the scale alpha / r kept), takes its slots of what
arrives, and sends its trained slots zero-padded to the wire ranks with a slot mask per layer, so the server can
average every slot over the members that have it (``strategies.atlas.ranks.slot_average``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.adapters.lora import LoraSection
from common.adapters.lora import ranks as lora_ranks

from ..base import Arrays
from ..fingerprint import FingerprintClient
from .config import AtlasSection

if TYPE_CHECKING:
    from client_app.runtime import ClientRuntime
    from common.adapters import ClientState

OWN_RANKS, WIRE_RANKS = "lora-ranks", "wire-ranks"  # instruction config keys: comma-separated, sorted layer order


def encode_ranks(ranks: dict[str, int]) -> str:
    return ",".join(str(ranks[path]) for path in sorted(ranks))


def decode_ranks(value: Any, paths: list[str]) -> dict[str, int]:
    numbers = [int(x) for x in str(value).split(",") if x.strip()]
    if len(numbers) != len(paths):
        raise ValueError(f"{len(numbers)} ranks for {len(paths)} LoRA layers")
    return dict(zip(sorted(paths), numbers))


class AtlasClient(FingerprintClient):
    """ATLAS on a client (see the module docstring)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.own: dict[str, int] | None = None
        self.wire: dict[str, int] | None = None

    def report(self, rt: ClientRuntime, state: ClientState, server_round: int) -> tuple[Arrays, dict[str, Any]]:
        rt.reattach(self.cfg)  # fingerprints at the run's initial adapter, whatever ranks were attached last
        arrays, metrics = super().report(rt, state, server_round)
        budget = self.cfg.section(AtlasSection).budget(rt.partition_id, rt.node_config)
        if budget is not None:
            metrics["memory_mb"] = budget
        return arrays, metrics

    def configure(self, rt: ClientRuntime, config: dict[str, Any]) -> None:
        if OWN_RANKS not in config:
            self.own = self.wire = None
            rt.reattach(self.cfg)
            return
        paths = list(lora_ranks.layers(rt.adapter.initial))
        self.own = decode_ranks(config[OWN_RANKS], paths)
        self.wire = decode_ranks(config[WIRE_RANKS], paths)
        lora = self.cfg.section(LoraSection)
        rt.reattach(self.cfg.with_section(lora.model_copy(update={"rank_pattern": self.own})))

    def wire_reference(self, rt: ClientRuntime, config: dict[str, Any]) -> Arrays:
        if self.own is None or self.wire is None:
            return rt.adapter.initial
        return {**lora_ranks.resize(rt.adapter.initial, self.wire), **lora_ranks.masks(self.own, self.wire)}

    def start(self, rt: ClientRuntime, received: Arrays | None) -> Arrays | None:
        """This client's slots of the group's adapter."""
        if received is None or self.own is None:
            return received
        return lora_ranks.resize(lora_ranks.without_masks(received), self.own)

    def outgoing(self, rt: ClientRuntime, arrays: Arrays, active: list[int] | None) -> tuple[Arrays, dict[str, Any]]:
        """The trained slots zero-padded to the wire ranks, with this client's slot masks."""
        if self.own is None or self.wire is None:
            return arrays, {}
        return {**lora_ranks.resize(arrays, self.wire), **lora_ranks.masks(self.own, self.wire)}, {}
