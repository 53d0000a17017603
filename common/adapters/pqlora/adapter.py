"""The PQ-LoRA adapter kind on a shared base model (FedMosaic's client side).

A client keeps its local P_L/Q_L and gates (which never leave it in secure mode) and its last received global
P_G/Q_G in its ``ClientState``; the server sends P_G/Q_G, the client returns P_L/Q_L of the active blocks only
(layerwise routing). Strategies may post-process what is sent (SimGrad aligns it onto P_G/Q_G).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..base import AdapterBase, Arrays, ClientState
from .config import PQLoraSection
from .model import (
    adapters_disabled,
    attach_pqlora,
    block_grad_norms,
    detach_pqlora,
    gate_parameters,
    get_gates,
    get_local_state,
    get_pq_arrays,
    reset_local_state,
    save_pq_adapter,
    set_local_state,
    set_pq_arrays,
    set_trainable_blocks,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from common.config import RunConfig, Section

LOCAL_STATE, GLOBAL_STATE = "pqlora.local", "pqlora.global"


class PQLoraAdapter(AdapterBase):
    """PQ-LoRA with client-local state (see the module docstring).

    Attributes:
        active_blocks: the blocks this message trains and sends and whose received global part ``received`` gives
            (layerwise routing, ``set_active_blocks``); None: every block. Every ``begin`` resets it to None.
    """

    name: ClassVar[str] = "pqlora"
    section: ClassVar[type[Section]] = PQLoraSection
    reply_metrics: ClassVar[dict[str, type | None]] = {"beta": float, "active_blocks": int}
    state_keys: ClassVar[tuple[str, ...]] = (LOCAL_STATE, GLOBAL_STATE)
    keeps_adapter: ClassVar[bool] = True
    trains_global: ClassVar[bool] = False  # PQLoraConfig.trains_global of what it attaches

    def attach(self, base: nn.Module, cfg: RunConfig) -> nn.Module:
        self.pq_config = cfg.section(PQLoraSection).adapter_config(cfg.seed, self.trains_global)
        self.gate_lr_scale = cfg.section(PQLoraSection).gate_lr_scale
        self.active_blocks: list[int] | None = None
        return attach_pqlora(base, self.pq_config)

    def arrays(self) -> Arrays:
        """The local P/Q of the active blocks (``initial``: every block's, zeros: the global part every client
        starts from)."""
        return get_pq_arrays(self.model, "local", blocks=self.active_blocks)

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        return str(cfg.section(PQLoraSection).adapter_config(cfg.seed, cls.trains_global).to_dict())

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        """Swap this client's state into the shared model; ``received`` (P_G/Q_G from the server) wins over the
        kept one. Every block is active until ``set_active_blocks`` says otherwise."""
        self.active_blocks = None
        local = state.get(LOCAL_STATE)
        if local is not None:
            set_local_state(self.model, local)
        else:
            reset_local_state(self.model)
        if received is None:
            received = state.get(GLOBAL_STATE)
        set_pq_arrays(self.model, received if received is not None else self.initial, part="global")  # initial: zeros

    def set_active_blocks(self, blocks: list[int] | None) -> None:
        """Train, send and align onto only ``blocks`` in this message (None: every block): a routing strategy's
        choice (SimGrad's ``route-budget``), set after ``begin``."""
        self.active_blocks = blocks

    def prepare_training(self) -> None:
        set_trainable_blocks(self.model, self.active_blocks)

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        if self.gate_lr_scale == 1.0:
            return None
        return self.regroup([([p for p in self.model.parameters() if p.requires_grad], 1.0)])

    def regroup(self, groups: list[tuple[list[nn.Parameter], float]]) -> list[tuple[list[nn.Parameter], float]]:
        """``groups`` with the trainable gate logits moved into a group of their own at ``pqlora.gate-learning-rate``
        (unchanged when that is the P/Q rate)."""
        if self.gate_lr_scale == 1.0:
            return groups
        gates = [p for p in gate_parameters(self.model) if p.requires_grad]
        moved = {id(p) for p in gates}
        return [([p for p in ps if id(p) not in moved], scale) for ps, scale in groups] + [(gates, self.gate_lr_scale)]

    def outgoing(self) -> tuple[Arrays, dict[str, Any]]:
        """The local P/Q of the active blocks, with the gates and the blocks as metrics."""
        metrics = {
            "beta": [float(b) for b in get_gates(self.model)],
            "active_blocks": list(self.active_blocks or range(self.pq_config.num_blocks)),
        }
        return self.arrays(), metrics

    def received(self) -> Arrays:
        """The global P/Q of the active blocks (what the server sent, or the client kept)."""
        return get_pq_arrays(self.model, "global", blocks=self.active_blocks)

    def end(self, state: ClientState) -> None:
        state.put(LOCAL_STATE, get_local_state(self.model))
        state.put(GLOBAL_STATE, get_pq_arrays(self.model, "global"))

    def disabled(self) -> AbstractContextManager[Any]:
        return adapters_disabled(self.model)

    def detach(self) -> nn.Module:
        return detach_pqlora(self.model)

    def salience(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> list[float]:
        """Gradient norm of the loss w.r.t. each block's P/Q (all blocks trainable), for layerwise routing."""
        set_trainable_blocks(self.model, None)
        self.model.zero_grad(set_to_none=True)
        loss_fn(self.model).backward()
        norms = block_grad_norms(self.model)
        self.model.zero_grad(set_to_none=True)
        return norms

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The client's full adapter (its local parts never leave it; the server holds a client's global P/Q only,
        as named arrays: the default ``save_server_copy``)."""
        return save_pq_adapter(self.model, self.pq_config, out_dir, base_model_name)
