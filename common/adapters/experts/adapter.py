"""The expert-pool adapter kind on a shared base model (VEMoE's, seed 002): every slot's expert arrives with every
message and may be sent back; the routers are the client's own and stay in its state.

Wire names: ``expert-<slot>.<peft name>`` for every slot of the pool (K_max experts, live or free, so every message
has one shape). Which slots are live, the client's responsibilities and its routing are the strategy's
(``strategies/vemoe``): it routes with ``route`` and probes one expert at a time with ``probe_loss``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..base import AdapterBase, Arrays, ClientState
from ..lora.config import LoraSection
from ..lora.model import save_peft_adapter
from .config import ExpertsSection
from .model import (
    attach_experts,
    detach_experts,
    expert_layers,
    experts_disabled,
    get_expert,
    get_routers,
    routing_of,
    set_expert,
    set_routers,
    trainable,
)

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section

ROUTERS = "experts.routers"  # client state: this client's routers (never sent)


def slot_prefix(slot: int) -> str:
    return f"expert-{slot}."


def split_slots(arrays: Arrays, k_max: int) -> list[Arrays]:
    """Wire arrays -> one peft-named expert per slot (KeyError naming the first slot with nothing)."""
    experts = [
        {k.removeprefix(slot_prefix(s)): v for k, v in arrays.items() if k.startswith(slot_prefix(s))}
        for s in range(k_max)
    ]
    if empty := [s for s, expert in enumerate(experts) if not expert]:
        raise KeyError(f"no arrays for expert slots {empty}")
    return experts


def join_slots(experts: list[Arrays]) -> Arrays:
    return {f"{slot_prefix(s)}{name}": array for s, expert in enumerate(experts) for name, array in expert.items()}


class ExpertsAdapter(AdapterBase):
    """A pool of ``experts.k-max`` LoRA experts with per-layer routers (``common.adapters.experts``)."""

    name: ClassVar[str] = "experts"
    section: ClassVar[type[Section]] = ExpertsSection
    state_keys: ClassVar[tuple[str, ...]] = (ROUTERS,)
    missing: ClassVar[str] = "the expert pool keeps no experts between messages: the server must send them"

    def attach(self, base: nn.Module, cfg: RunConfig) -> nn.Module:
        self.pool = cfg.section(ExpertsSection)
        model = attach_experts(base, self.pool, seed=cfg.seed)
        self._initial_routers = get_routers(model)
        return model

    def arrays(self) -> Arrays:
        """Every slot as it is now (after training the routed ones trained; the strategy weights them)."""
        return join_slots([get_expert(self.model, s) for s in range(self.pool.k_max)])

    def load(self, arrays: Arrays) -> None:
        for slot, expert in enumerate(split_slots(arrays, self.pool.k_max)):
            set_expert(self.model, slot, expert)

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        """Every slot from what the server sent; this client's routers from its state (zero at first: tokens get
        the domain mixture r until the router learns)."""
        super().begin(state, received)
        set_routers(self.model, state.get(ROUTERS) or self._initial_routers)
        routing_of(self.model).route([], [])

    def route(self, slots: list[int], r: list[float]) -> None:
        """Route tokens between ``slots`` with responsibilities ``r`` for this message (training and evaluation)."""
        routing_of(self.model).route(slots, r)

    @torch.no_grad()
    def probe_loss(self, slot: int | None, loss_of: Any) -> float:
        """``loss_of(model)`` with every token routed to expert ``slot`` alone: how well it serves a probe batch
        (``slot`` None: no expert routed, what the experts are measured from)."""
        routing = routing_of(self.model)
        before = (routing.slots, routing.log_r)
        try:
            routing.route(*(([], []) if slot is None else ([slot], [1.0])))
            return float(loss_of(self.model))
        finally:
            routing.slots, routing.log_r = before

    def probe_gain(self, slot: int, loss_of: Any) -> float:
        """||d loss_of(model) / d B_slot||^2 with every token routed to expert ``slot`` alone: the first-order loss
        decrease a small step on that expert offers. Experts still at B = 0 all compute the base model, so their probe
        losses tie exactly; their gains do not (each slot has its own random A) and follow the client's data."""
        routing = routing_of(self.model)
        before = (routing.slots, routing.log_r)
        params = [layer.lora_B for layer in expert_layers(self.model)]
        wanted = [param.requires_grad for param in params]
        try:
            for param in params:
                param.requires_grad_(True)
            routing.route([slot], [1.0])
            grads = torch.autograd.grad(loss_of(self.model), params, allow_unused=True)
            return float(sum(float((g[slot].double() ** 2).sum()) for g in grads if g is not None))
        finally:
            routing.slots, routing.log_r = before
            for param, flag in zip(params, wanted):
                param.requires_grad_(flag)

    def prepare_training(self) -> None:
        """The experts and routers train (only the routed slots get gradients); the base stays frozen."""
        trainable(self.model)

    def end(self, state: ClientState) -> None:
        state.put(ROUTERS, get_routers(self.model))

    def disabled(self) -> AbstractContextManager[Any]:
        return experts_disabled(self.model)

    def detach(self) -> nn.Module:
        return detach_experts(self.model)

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The server's copy is the whole pool (``save_server_copy``); the routers are this client's, saved beside."""
        out_dir.mkdir(parents=True, exist_ok=True)
        routers: dict[str, Any] = dict(get_routers(self.model))
        np.savez(out_dir / "routers.npz", **routers)
        return out_dir

    @staticmethod
    def save_server_copy(arrays: Arrays, cfg: RunConfig, base_model_name: str, out_dir: Path) -> Path:
        """One PEFT LoRA directory per expert that is not all zero (``expert-<slot>/``), each loadable alone."""
        pool = cfg.section(ExpertsSection)
        lora = LoraSection(r=pool.r, alpha=pool.alpha, target_modules=pool.target_modules)
        out_dir.mkdir(parents=True, exist_ok=True)
        for slot, expert in enumerate(split_slots(arrays, pool.k_max)):
            if any(np.any(value) for name, value in expert.items() if ".lora_B." in name):
                peft_names = {f"base_model.model.{name}": value for name, value in expert.items()}
                save_peft_adapter(peft_names, lora, base_model_name, out_dir / f"expert-{slot}")
        return out_dir
