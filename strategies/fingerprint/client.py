"""The client half shared by ATLAS and MIRA: the task-fingerprint report.

The gradient is taken at the run's INITIAL adapter (the same seeded LoRA on every client of a base model), so
fingerprints compare the clients' data, not how far each client's adapter has moved; it is re-taken on the
rounds the server asks (``atlas.recluster-every``, ``mira.refresh-every``) on a fresh sample of batches.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from common.adapters.personal import DualPath
from common.logs import get_logger

from ..base import Arrays
from ..client import ClientRuntime, StrategyClient
from ..sketches import sanitize_signature
from .config import FingerprintSection
from .gradients import adapter_gradients, layer_normalised, layer_norms, sketch
from .wire import FINGERPRINT, FINGERPRINT_BATCHES, LAYER_IMPORTANCE, LAYER_NAMES

if TYPE_CHECKING:
    from common.adapters import ClientState
    from common.data import Example

log = get_logger("tessera.client")
FINGERPRINT_EMA = "fingerprint.ema"


def fingerprint_batches(examples: list[Example], batches: int, batch_size: int, seed: int) -> list[list[Example]]:
    """``batches`` batches of ``batch_size`` drawn by passes over a seeded shuffle of ``examples`` (a client with
    few examples sees each more than once, like its local training)."""
    rng = random.Random(seed)
    order: list[Example] = []
    while len(order) < batches * batch_size and examples:
        epoch = list(examples)
        rng.shuffle(epoch)
        order.extend(epoch)
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(batches)]


class FingerprintClient(StrategyClient):
    """A client half that reports task fingerprints (ATLAS and MIRA build theirs on it).

    Report: arrays ``{"fingerprint": sketch-dim numbers}``; metrics ``layer_names`` and ``layer_importance`` (the
    gradient norm of every adapted layer, for ATLAS's rank allocation) and ``fingerprint_batches``.
    """

    state_keys: ClassVar[tuple[str, ...]] = (FINGERPRINT_EMA,)

    def report(self, rt: ClientRuntime, state: ClientState, server_round: int) -> tuple[Arrays, dict[str, Any]]:
        cfg = self.cfg.section(FingerprintSection)
        adapter = rt.adapter
        adapter.begin(state, adapter.initial)
        adapter.prepare_training()
        if isinstance(adapter, DualPath):  # its personal LoRA at its start (B zero: no output) and frozen
            adapter.personal.at_start()
        seed = rt.cfg.seed * 7919 + server_round * 31 + rt.partition_id
        batches = fingerprint_batches(rt.train, cfg.batches, rt.cfg.train.batch_size, seed)
        grads = adapter_gradients(adapter.model, rt.tokenizer, batches, rt.cfg.train.max_seq_len)
        fingerprinted = grads.last_blocks(cfg.blocks)
        vector = layer_normalised(grads.gradients, fingerprinted)
        raw = sketch(vector, cfg.sketch_dim, seed=rt.cfg.seed)  # the run's seed: one sketch for every client
        kept = state.get(FINGERPRINT_EMA)
        noise_rng = np.random.default_rng([rt.cfg.seed, server_round, rt.partition_id, 17])
        fingerprint, ema = sanitize_signature(
            raw, None if kept is None else kept["ema"], cfg.ema_decay, cfg.noise_scale, cfg.keep_fraction, noise_rng
        )
        state.put(FINGERPRINT_EMA, {"ema": ema})
        norms = layer_norms(grads.gradients)
        log.info(
            "partition %d round %d: fingerprint of %d layers over %d batches -> %d numbers",
            rt.partition_id,
            server_round,
            len(fingerprinted),
            grads.batches,
            fingerprint.size,
        )
        metrics = {
            LAYER_NAMES: list(norms),
            LAYER_IMPORTANCE: [norms[name] for name in norms],
            FINGERPRINT_BATCHES: grads.batches,
        }
        return {FINGERPRINT: fingerprint}, metrics
