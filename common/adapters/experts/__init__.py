"""A pool of LoRA experts with token routing (VEMoE's adapter, seed 002): ``config.py`` (what), ``layer.py`` (the
per-layer math), ``model.py`` (the surgery), ``adapter.py`` (the kind a client trains: ``ExpertsAdapter``)."""

from .config import ExpertsSection
from .layer import ExpertLinear, ExpertRouting, token_mixture
from .model import (
    attach_experts,
    detach_experts,
    experts_disabled,
    get_expert,
    get_routers,
    routed,
    set_expert,
    set_routers,
    trainable,
)

__all__ = [
    "ExpertLinear",
    "ExpertRouting",
    "ExpertsSection",
    "attach_experts",
    "detach_experts",
    "experts_disabled",
    "get_expert",
    "get_routers",
    "routed",
    "set_expert",
    "set_routers",
    "token_mixture",
    "trainable",
]
