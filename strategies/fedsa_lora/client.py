"""FedSA-LoRA's client half: train the whole LoRA, send the A matrices, keep the B matrices.

The server sends (and evaluates with) the global A only; the client puts its own B beside it (the initial B, zero
as peft initialises it, until it first trains), trains both, keeps the new B in its declared client state and
sends the new A. A trained B never leaves the client: train replies carry A alone (the server refuses any other
layout), evaluate replies carry metrics, and the initial query (before round 1) is answered with the seeded initial
adapter, whose B is zero on every client. B lives as long as the client state does (a SuperNode, or in simulation
the run): after a resume, or a restarted SuperNode, it starts again from the initial B under the checkpointed
global A.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from common.messages import Part

from ..base import Arrays
from ..client import ClientRuntime, StrategyClient, save_whole_adapter
from .selective import merge, private_part, shared_part, split

OWN_B = "fedsa-lora.B"  # the client-state key of this client's B matrices


class FedSALoraClient(StrategyClient):
    """The client half of FedSA-LoRA (see the module docstring): A travels, B stays in the client state."""

    state_keys: ClassVar[tuple[str, ...]] = (OWN_B,)

    def wire_reference(self, rt: ClientRuntime, wire: Part | None) -> Arrays:
        """What the server sends and a train reply carries: the adapter's A matrices."""
        return shared_part(rt.adapter.initial)

    def start(self, rt: ClientRuntime, received: Arrays | None) -> Arrays | None:
        """The global A the server sent beside this client's own B (the initial B before it first trains)."""
        if not received:
            raise ValueError("strategy 'fedsa-lora': the server sent no A matrices")
        own = rt.state.get(OWN_B)
        return merge(received, own if own is not None else private_part(rt.adapter.initial), rt.adapter.initial)

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """Keep the trained B; send the trained A."""
        shared, private = split(arrays)
        rt.state.put(OWN_B, private)
        return shared, {}

    def save(self, rt: ClientRuntime, out_dir: Path) -> Path | None:
        """The only complete copy of this client's adapter (the global A and its B) as a PEFT directory."""
        return save_whole_adapter(rt, out_dir)
