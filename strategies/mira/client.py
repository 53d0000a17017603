"""MIRA's client half: the fingerprint report (shared with ATLAS) and the client's own LoRA, kept in its node
state, stepped toward the neighbour term the server sends.

The step is recomputed from the kept (trained, unstepped) adapter on every message that carries the neighbour
term, so the round's evaluation and the next round's training start from the same W_k <- (1 - eta) W_k + eta N_k.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..base import Arrays
from ..client import ClientRuntime, save_whole_adapter
from ..fingerprint import FingerprintClient
from ..fingerprint.laplacian import laplacian_start
from .config import MiraSection

OWN_ADAPTER = "mira.adapter"


def same_arrays(a: Arrays, b: Arrays) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class MiraClient(FingerprintClient):
    """MIRA on a client (see the module docstring)."""

    state_keys: ClassVar[tuple[str, ...]] = (*FingerprintClient.state_keys, OWN_ADAPTER)

    def start(self, rt: ClientRuntime, received: Arrays | None) -> Arrays | None:
        """The client's adapter after the Laplacian step: its kept adapter mixed with the neighbour term received.

        Before it has trained (round 1, or a fresh node state after a restart) it starts from what was sent: the
        initial adapter, or its neighbours' mean. The initial adapter itself is never a neighbour term (the server
        sends it while it has none), so it does not pull a trained adapter back.
        """
        neighbours = bool(received) and not same_arrays(received or {}, rt.adapter.initial)
        eta = self.cfg.section(MiraSection).eta
        return laplacian_start(rt.state.get(OWN_ADAPTER), received, rt.adapter.initial, eta, neighbours)

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """Keep the trained adapter (the step's W_k); send it for the neighbour terms."""
        rt.state.put(OWN_ADAPTER, arrays)
        return arrays, {}

    def save(self, rt: ClientRuntime, out_dir: Path) -> Path | None:
        """The client's stepped adapter is its only copy (PEFT directory)."""
        return save_whole_adapter(rt, out_dir)
