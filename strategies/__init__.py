"""Server strategies. Each file holds one strategy; their math is pure functions (``aggregation.py``)."""

from .base import Group, GroupResult, Strategy
from .fedavg import FedAvg

REGISTRY: dict[str, type[Strategy]] = {FedAvg.name: FedAvg}


def build_strategy(name: str) -> Strategy:
    if name not in REGISTRY:
        raise ValueError(f"strategy: '{name}' is not implemented (have {sorted(REGISTRY)})")
    return REGISTRY[name]()


__all__ = ["FedAvg", "Group", "GroupResult", "Strategy", "build_strategy", "REGISTRY"]
