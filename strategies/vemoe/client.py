"""VEMoE's client half: probe every live expert on a batch of the client's own data, turn the losses into
responsibilities r, route its tokens between its top-m experts, and send the constant-length payload of ``pool.py``
(its trained experts weighted by r, r itself, and its birth vote with a candidate in the free slot).

The client votes for a new expert when its best expert's probe loss is above ``vemoe.birth-threshold`` times the
best it has seen in earlier rounds on the same probe batch (the pool has drifted away from it), or, with
``vemoe.birth-spread`` > 0, when no expert serves it distinctively (its r as spread as that share of uniform:
``routing.unserved``; never on round 1's tie); its candidate is its trained copy of its best expert.

In round 1 every expert still computes the base model (B = 0), so the probe losses tie exactly: by default
(``vemoe.first-round = "gradient"``) r is each expert's share of the first-order gain a step on it offers (the
squared gradient of the probe loss in its B, ``routing.gain_shares``), which differs by slot (each has its own random
A) and follows the client's data; with ``"spread"`` the tie goes in a per-client order. Its responsibilities and best
loss stay in its state, so an evaluation routes as its training did.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from common.adapters.experts import ExpertsSection
from common.adapters.experts.adapter import ExpertsAdapter, split_slots
from common.logs import get_logger
from common.messages import Part
from common.training import answer_tokens, batch_loss

from ..base import Arrays
from ..client import ClientRuntime, StrategyClient
from .config import VemoeSection
from .pool import client_payload
from .routing import gain_shares, responsibilities, tied, top_m, unserved
from .wire import BESIDE_POOL, RESPONSIBILITY, VemoeWire, beside_pool, routing_metrics

log = get_logger("tessera.client")
ROUTE = "vemoe.route"  # client state: this client's responsibilities (K_max) and the best probe loss it has seen


class VEMoEClient(StrategyClient):
    """VEMoE on a client (see the module docstring)."""

    state_keys: ClassVar[tuple[str, ...]] = (ROUTE,)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.pool, self.vemoe = cfg.section(ExpertsSection), cfg.section(VemoeSection)
        self.live = np.zeros(self.pool.k_max, dtype=bool)
        self.birth_slot = -1
        self.prior: np.ndarray | None = None  # the server's counted prior over slots (vemoe.likelihood = "summed")
        self.r = np.zeros(self.pool.k_max)
        self.top: list[int] = []
        self.vote = False
        self.losses = np.full(self.pool.k_max, np.nan)  # this round's probe loss per slot (NaN: free slot)
        self.base_loss = np.nan  # the probe loss with no expert routed (the experts' moves are measured from it)

    def _experts(self, rt: ClientRuntime) -> ExpertsAdapter:
        if not isinstance(rt.adapter, ExpertsAdapter):
            raise ValueError(f"vemoe trains the expert pool, not {type(rt.adapter).__name__}")
        return rt.adapter

    def wire_reference(self, rt: ClientRuntime, wire: Part | None) -> Arrays:
        return {**rt.adapter.initial, **beside_pool(self.pool.k_max)}

    def start(self, rt: ClientRuntime, received: Arrays | None) -> Arrays | None:
        """The experts for the adapter; the live slots (sent as ``responsibility``: 1 or 0) kept for ``ready``."""
        if received is None:
            return None
        self.live = np.asarray(received[RESPONSIBILITY]) > 0.5
        return {k: v for k, v in received.items() if k not in BESIDE_POOL}

    def configure(self, rt: ClientRuntime, wire: Part | None) -> None:
        part = wire if isinstance(wire, VemoeWire) else VemoeWire()
        self.birth_slot = part.birth_slot
        self.prior = np.array(part.prior) if part.prior else None

    def ready(self, rt: ClientRuntime, wire: Part | None, training: bool) -> None:
        """Probe (in training; in evaluation only without kept responsibilities) and route."""
        kept = rt.state.get(ROUTE)
        if training or kept is None or not np.all(self.live[np.asarray(kept["r"]) > 0]):
            losses = self.losses = self._probe(rt)
            self.base_loss = self._base_loss(rt) if training else np.nan
            self.r = self._responsibilities(rt, losses)
            best = float(np.min(losses[self.live]))
            before = float(kept["best"][0]) if kept is not None else np.inf
            drifted = best > self.vemoe.birth_threshold * before  # the pool moved away from it
            alone = not tied(losses, self.live) and unserved(self.r, self.live, self.vemoe.birth_spread)
            self.vote = training and self.birth_slot >= 0 and (drifted or alone)
            rt.state.put(ROUTE, {"r": self.r.astype(np.float32), "best": np.array([min(best, before)], np.float32)})
        else:
            self.r = np.asarray(kept["r"], dtype=np.float64)
        ties = np.random.default_rng([rt.cfg.seed, rt.partition_id]).permutation(self.pool.k_max)
        self.top = top_m(self.r, self.pool.top_m, ties).tolist()
        self._experts(rt).route(self.top, [float(self.r[k]) for k in self.top])

    def _responsibilities(self, rt: ClientRuntime, losses: np.ndarray) -> np.ndarray:
        oracle = self.vemoe.oracle.get(rt.tasks)
        if oracle is not None:  # the oracle run: this client's category has its own expert, by hand
            return np.eye(self.pool.k_max)[oracle]
        if self.vemoe.first_round == "gradient" and tied(losses, self.live):  # the base model: gradients decide
            return gain_shares(self._probe(rt, gains=True), self.live)
        if self.vemoe.likelihood == "summed":  # the posterior: summed log-likelihood, the counted prior
            tokens = answer_tokens(rt.tokenizer, self._batch(rt), rt.cfg.train.max_seq_len)
            return responsibilities(losses * tokens, self.live, 1.0, self.prior)
        return responsibilities(losses, self.live, self.vemoe.temperature)

    def _batch(self, rt: ClientRuntime) -> list:
        # the same probe batch every round: the birth vote compares this round's best loss with earlier rounds'
        rng = random.Random(rt.cfg.seed * 7919 + rt.partition_id)
        return rng.sample(rt.train, min(self.vemoe.probe_examples, len(rt.train)))

    def _probe_loss_of(self, rt: ClientRuntime) -> Callable[[Any], Any]:
        """The loss on this client's probe batch, as a function of the model (what every probe measures)."""
        batch, max_len = self._batch(rt), rt.cfg.train.max_seq_len
        return lambda model: batch_loss(model, rt.tokenizer, batch, max_len)

    def _base_loss(self, rt: ClientRuntime) -> float:
        """The probe loss with no expert routed: each expert's move (what the functional distance is relative to)."""
        return self._experts(rt).probe_loss(None, self._probe_loss_of(rt))

    def _probe(self, rt: ClientRuntime, gains: bool = False) -> np.ndarray:
        """Each live expert's loss on the probe batch (``gains``: its first-order gain, ``probe_gain``)."""
        adapter, loss_of = self._experts(rt), self._probe_loss_of(rt)
        measure = adapter.probe_gain if gains else adapter.probe_loss
        losses = np.full(self.pool.k_max, np.nan)
        for slot in np.flatnonzero(self.live):
            losses[slot] = measure(int(slot), loss_of)
        return losses

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """The payload: its top-m experts as trained, weighted by r renormalised over them (what it trained)."""
        slots = split_slots(arrays, self.pool.k_max)
        r = np.zeros(self.pool.k_max)
        r[self.top] = self.r[self.top] / self.r[self.top].sum()
        best = max(self.top, key=lambda k: r[k])
        candidate = slots[best] if self.vote else None
        payload = client_payload(
            {k: slots[k] for k in self.top},
            r,
            slots[0],
            self.birth_slot if self.vote else None,
            candidate,
            probe=(self.losses, self.base_loss),
        )
        # what routing decided (probe loss per slot, -1 for a free one; r; the top-m; the vote), so that separation
        # is measured; which experts a client uses and whether it voted are exactly what SecAgg+ hides: said in the
        # clear only, kept in the client's own log in secure mode
        routing = routing_metrics(self.losses, self.r, self.top, self.vote)
        if self.cfg.secure:
            log.info("vemoe routing (kept on this client): %s", routing)
        return payload, {} if self.cfg.secure else routing
