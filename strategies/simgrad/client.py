"""SimGrad's client half: the per-round signature report, the routing of training, and the alignment of what is
sent.

The report is a sanitised gradient signature of a shared FROZEN probe model (``signatures.py``) and the
gradient norm of every PQ-LoRA block (layerwise routing). Each message the client routes its PQ-LoRA adapter to
the blocks its group's instruction names (``wire.ACTIVE_BLOCKS``): only those train and are sent. What is sent
after training (the local P/Q of the routed blocks) is Procrustes-aligned onto the global P/Q the client received
(``common.adapters.pqlora.alignment``). The signature EMA is the state SimGrad keeps on a client.
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from common.adapters.pqlora import PQLoraAdapter, PQLoraSection, align_arrays, synthetic_anchors
from common.logs import get_logger
from common.messages import Part
from common.training import batch_loss

from ..base import Arrays
from ..client import ClientRuntime, StrategyClient
from .config import SimGradSection
from .signatures import probe_gradient, sanitize_signature
from .wire import ALIGN_ERROR_AFTER, ALIGN_ERROR_BEFORE, SALIENCE, SIGNATURE, SimGradWire

if TYPE_CHECKING:
    from common.adapters import ClientState

log = get_logger("tessera.client")
SIGNATURE_EMA = "simgrad.ema"


@lru_cache(maxsize=8)
def _anchors(r: int, count: int, seed: int) -> np.ndarray:
    return synthetic_anchors(r, count, seed=seed)  # shared by every client, data-free


class SimGradClient(StrategyClient):
    """SimGrad on a client (see the module docstring)."""

    state_keys: ClassVar[tuple[str, ...]] = (SIGNATURE_EMA,)

    def ready(self, rt: ClientRuntime, wire: Part | None, training: bool) -> None:
        """Route the PQ-LoRA adapter to the blocks this instruction names (every block when it names none)."""
        blocks = wire.active_blocks if isinstance(wire, SimGradWire) else None
        _pqlora(rt, "routing needs").set_active_blocks(list(blocks) if blocks else None)

    def report(self, rt: ClientRuntime, state: ClientState, server_round: int) -> tuple[Arrays, dict[str, Any]]:
        cfg = self.cfg.section(SimGradSection)
        adapter = _pqlora(rt, "signature reports need")
        rng = random.Random(rt.cfg.seed * 7919 + server_round * 31 + rt.partition_id)
        examples = rng.sample(rt.train, min(cfg.probe_examples, len(rt.train)))
        adapter.begin(state, None)
        batch = examples[: rt.cfg.train.batch_size]
        salience = adapter.salience(lambda model: batch_loss(model, rt.tokenizer, batch, rt.cfg.train.max_seq_len))
        probe = rt.probe(cfg.probe_model)
        with probe.adapter.disabled() if probe.adapter is not None else nullcontext():  # the FROZEN base
            gradient = probe_gradient(
                probe.model,
                probe.tokenizer,
                examples,
                cfg.sketch_buckets,
                seed=rt.cfg.seed,
                max_len=rt.cfg.train.max_seq_len,
            )
        kept = state.get(SIGNATURE_EMA)
        noise_rng = np.random.default_rng([rt.cfg.seed, server_round, rt.partition_id])
        signature, ema = sanitize_signature(
            gradient,
            None if kept is None else kept["ema"],
            cfg.ema_decay,
            cfg.noise_scale,
            cfg.keep_fraction,
            noise_rng,
        )
        state.put(SIGNATURE_EMA, {"ema": ema})
        log.info(
            "partition %d round %d: signature %d numbers, salience %s",
            rt.partition_id,
            server_round,
            signature.size,
            [f"{s:.3g}" for s in salience],
        )
        return {SIGNATURE: signature}, {SALIENCE: [float(s) for s in salience]}

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """The local P/Q aligned onto the received global ones (when ``simgrad.alignment``), with the errors."""
        cfg = self.cfg.section(SimGradSection)
        if not cfg.alignment:
            return arrays, {}
        anchors = _anchors(self.cfg.section(PQLoraSection).r, cfg.anchors, self.cfg.seed)
        aligned, errors = align_arrays(arrays, rt.adapter.received(), anchors)
        before = [e[0] for e in errors.values() if math.isfinite(e[0])]
        after = [e[1] for e in errors.values() if math.isfinite(e[1])]
        if not before:  # round 1 has no trained reference yet: nothing to align
            return aligned, {}
        return aligned, {ALIGN_ERROR_BEFORE: float(np.mean(before)), ALIGN_ERROR_AFTER: float(np.mean(after))}


def _pqlora(rt: ClientRuntime, what_needs: str) -> PQLoraAdapter:
    if not isinstance(rt.adapter, PQLoraAdapter):
        raise ValueError(f"{what_needs} the PQ-LoRA adapter, not {rt.adapter.name}")
    return rt.adapter
