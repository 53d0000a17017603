"""Server strategies. Each file holds one strategy; their math is pure functions (``aggregation.py``, ``relevance.py``)."""

from common.config import RunConfig

from .base import ClientInfo, ClientReport, Group, GroupResult, Strategy
from .fedavg import FedAvg
from .simgrad import SimGrad

REGISTRY: dict[str, type[Strategy]] = {FedAvg.name: FedAvg, SimGrad.name: SimGrad}


def build_strategy(cfg: RunConfig) -> Strategy:
    """The strategy a validated run config asks for."""
    if cfg.strategy == SimGrad.name:
        return SimGrad(cfg.simgrad, secure=cfg.secure)
    if cfg.strategy == FedAvg.name:
        return FedAvg()
    raise ValueError(f"strategy: '{cfg.strategy}' is not implemented (have {sorted(REGISTRY)})")


__all__ = ["ClientInfo", "ClientReport", "FedAvg", "Group", "GroupResult", "SimGrad", "Strategy", "build_strategy", "REGISTRY"]
