"""The local-only baseline on a client: train from its own adapter, send none of it.

An adapter kind with client state (PQ-LoRA) already keeps what a client trained when the server sends nothing;
one without (LoRA: "the server sends everything") has its trained arrays kept here, under ``local.adapter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ..base import Arrays
from ..client import ClientRuntime, StrategyClient, save_whole_adapter

OWN_ADAPTER = "local.adapter"


class LocalClient(StrategyClient):
    """Local-only training on a client (see the module docstring)."""

    state_keys: ClassVar[tuple[str, ...]] = (OWN_ADAPTER,)

    def start(self, rt: ClientRuntime, received: Arrays | None) -> Arrays | None:
        """The client's own adapter: kept by the adapter kind (None), or here, or the initial one (round 1)."""
        if received:
            raise ValueError("strategy 'local': the server sent an adapter; local-only clients train their own")
        if rt.adapter.state_keys:
            return None
        return rt.state.get(OWN_ADAPTER) or rt.adapter.initial

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """Keep the trained adapter; send nothing."""
        if not rt.adapter.state_keys:
            rt.state.put(OWN_ADAPTER, arrays)
        return {}, {}

    def save(self, rt: ClientRuntime, out_dir: Path) -> Path | None:
        """The client's adapter is the only copy: saved the way the kind saves a whole one (PEFT for LoRA)."""
        return save_whole_adapter(rt, out_dir)
