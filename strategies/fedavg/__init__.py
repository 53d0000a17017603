"""FedAvg: the example-weighted mean of full LoRA adapters (or of SubLoRA's alpha: ``fedavg.adapter``), per
base-model family. Its math is ``strategies.aggregation.weighted_mean`` (shared); its client half adds nothing to
the base one.

``fedavg-dual`` is the same server over the global half of a dual-path adapter (``lora-dual``: a personal LoRA
beside it stays on each client): the baseline for SimGrad's LoRA local path.
"""

from ..client import StrategyClient
from ..spec import StrategySpec
from .config import FedAvgSection
from .server import FedAvg, FedAvgDual, family_key

SPEC = StrategySpec(
    name=FedAvg.name,
    server=FedAvg,
    client=StrategyClient,
    adapter="lora",
    section=FedAvgSection,
    adapter_from=lambda cfg: cfg.section(FedAvgSection).adapter,
    dp_refusal=None,  # one sum per model family, nothing else
    record_dp_refusal=None,  # the update is post-processing of the DP-SGD steps
)
SPEC_DUAL = StrategySpec(  # the shared path's sum; the personal LoRA never leaves the node
    name=FedAvgDual.name,
    server=FedAvgDual,
    client=StrategyClient,
    adapter="lora-dual",
    dp_refusal=None,
    record_dp_refusal=None,  # both paths train by DP-SGD: the shared update is post-processing of it
)

__all__ = ["SPEC", "SPEC_DUAL", "FedAvg", "FedAvgDual", "FedAvgSection", "family_key"]
