"""FedAvg: the example-weighted mean of full LoRA adapters, per base-model family. Its math is
``strategies.aggregation.weighted_mean`` (shared); its client half adds nothing to the base one."""

from ..client import StrategyClient
from ..registry import StrategySpec
from .server import FedAvg, family_key

SPEC = StrategySpec(name=FedAvg.name, server=FedAvg, client=StrategyClient, adapter="lora")

__all__ = ["SPEC", "FedAvg", "family_key"]
