"""Client-side adapter handling per adapter kind: what arrives, what is trained, what is sent, what is kept.

One process serves several virtual clients and keeps ONE model, so everything that belongs to a client lives in
its Flower ``context.state`` and is swapped into the shared model per message:
- LoRA (FedAvg): nothing is kept; the server sends the whole adapter every time.
- PQ-LoRA (SimGrad): the client keeps its local P_L/Q_L and gates (which never leave it in secure mode), its last
  received global P_G/Q_G and its signature EMA; the server sends P_G/Q_G, the client returns P_L/Q_L of the
  active blocks only (layerwise routing), optionally Procrustes-aligned onto P_G/Q_G first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context

from common.adapters import attach_lora, get_adapter_arrays, set_adapter_arrays
from common.adapters.pqlora import (
    PQLoraConfig,
    align_arrays,
    attach_pqlora,
    block_grad_norms,
    get_gates,
    get_local_state,
    get_pq_arrays,
    reset_local_state,
    save_pq_adapter,
    set_local_state,
    set_pq_arrays,
    set_trainable_blocks,
    synthetic_anchors,
)
from common.config import RunConfig
from common.records import from_array_record, to_array_record

LOCAL_STATE, GLOBAL_STATE, SIGNATURE_EMA = "pqlora.local", "pqlora.global", "simgrad.ema"


class LoraAdapter:
    """peft LoRA: the server's adapter replaces the client's every message; all of it trains and travels."""

    kind = "lora"

    def __init__(self, base, cfg: RunConfig) -> None:
        self.model = attach_lora(base, cfg.lora, seed=cfg.seed)
        self.initial = get_adapter_arrays(self.model)
        self.names = sorted(self.initial)

    def begin(self, context: Context, received: dict[str, np.ndarray] | None) -> None:
        if received is not None:
            set_adapter_arrays(self.model, received)

    def prepare_training(self, active: list[int] | None) -> None:
        """LoRA has no routing: every weight trains."""

    def outgoing(self, active: list[int] | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return get_adapter_arrays(self.model), {}

    def end(self, context: Context) -> None:
        """Nothing client-local to keep."""


def pqlora_config(cfg: RunConfig) -> PQLoraConfig:
    pq = cfg.pqlora
    return PQLoraConfig(r=pq.r, num_blocks=pq.blocks, target_modules=tuple(pq.target_modules), scaling=pq.scaling, gate_init=pq.gate_init, seed=cfg.seed)


class PQLoraAdapter:
    """PQ-LoRA with client-local state in ``context.state`` (see the module docstring)."""

    kind = "pqlora"

    def __init__(self, base, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.pq_config = pqlora_config(cfg)
        self.model = attach_pqlora(base, self.pq_config)
        self.initial = get_pq_arrays(self.model, "local")  # zeros: the global part every client starts from
        self.names = sorted(self.initial)
        self.anchors = synthetic_anchors(cfg.pqlora.r, cfg.simgrad.anchors, seed=cfg.seed)  # shared, data-free

    def begin(self, context: Context, received: dict[str, np.ndarray] | None) -> None:
        """Swap this client's state into the shared model; ``received`` (P_G/Q_G from the server) wins over the kept one."""
        if LOCAL_STATE in context.state:
            set_local_state(self.model, from_array_record(context.state.array_records[LOCAL_STATE]))
        else:
            reset_local_state(self.model)
        if received is None and GLOBAL_STATE in context.state:
            received = from_array_record(context.state.array_records[GLOBAL_STATE])
        set_pq_arrays(self.model, received if received is not None else self.initial, part="global")  # initial: zeros

    def prepare_training(self, active: list[int] | None) -> None:
        set_trainable_blocks(self.model, active)

    def outgoing(self, active: list[int] | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The local P/Q of the active blocks (aligned onto the received global ones when configured) and metrics."""
        arrays = get_pq_arrays(self.model, "local", blocks=active)
        metrics: dict[str, Any] = {"beta": [float(b) for b in get_gates(self.model)], "active_blocks": list(active or range(self.pq_config.num_blocks))}
        if self.cfg.simgrad.alignment:
            reference = get_pq_arrays(self.model, "global", blocks=active)
            arrays, errors = align_arrays(arrays, reference, self.anchors)
            before = [e[0] for e in errors.values() if math.isfinite(e[0])]
            after = [e[1] for e in errors.values() if math.isfinite(e[1])]
            if before:  # round 1 has no trained reference yet: nothing to align
                metrics["align_error_before"] = float(np.mean(before))
                metrics["align_error_after"] = float(np.mean(after))
        return arrays, metrics

    def end(self, context: Context) -> None:
        context.state[LOCAL_STATE] = to_array_record(get_local_state(self.model))
        context.state[GLOBAL_STATE] = to_array_record(get_pq_arrays(self.model, "global"))

    def salience(self, loss_fn) -> list[float]:
        """Gradient norm of the loss w.r.t. each block's P/Q (all blocks trainable), for layerwise routing."""
        set_trainable_blocks(self.model, None)
        self.model.zero_grad(set_to_none=True)
        loss_fn(self.model).backward()
        norms = block_grad_norms(self.model)
        self.model.zero_grad(set_to_none=True)
        return norms

    def signature_ema(self, context: Context) -> np.ndarray | None:
        if SIGNATURE_EMA in context.state:
            return from_array_record(context.state.array_records[SIGNATURE_EMA])["ema"]
        return None

    def keep_signature_ema(self, context: Context, ema: np.ndarray) -> None:
        context.state[SIGNATURE_EMA] = to_array_record({"ema": ema})

    def save(self, out_dir: Path, base_model_name: str) -> Path:
        return save_pq_adapter(self.model, self.pq_config, out_dir, base_model_name)


def build_adapter(base, cfg: RunConfig) -> LoraAdapter | PQLoraAdapter:
    return PQLoraAdapter(base, cfg) if cfg.adapter == "pqlora" else LoraAdapter(base, cfg)
