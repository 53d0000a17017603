"""Server strategies. Each is one package (server half, client half, config section, pure math, plots) reached
through ``registry``; ``base`` and ``client`` are the two small bases, ``aggregation`` the shared group math."""

from .base import ClientInfo, FinalAdapter, Group, GroupResult, Strategy
from .client import StrategyClient
from .registry import REGISTRY, load_run_config, register, strategy_spec
from .spec import StrategySpec

__all__ = [
    "REGISTRY",
    "ClientInfo",
    "FinalAdapter",
    "Group",
    "GroupResult",
    "Strategy",
    "StrategyClient",
    "StrategySpec",
    "load_run_config",
    "register",
    "strategy_spec",
]
