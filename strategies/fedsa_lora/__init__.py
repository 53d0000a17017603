"""FedSA-LoRA (Guo et al., ICLR 2025, "Selective Aggregation for Low-Rank Adaptation in Federated Learning"): every
client trains a whole LoRA (``lora.*``, as FedAvg's); only the A matrices are sent and averaged (example-weighted,
per base-model family), the B matrices stay on each client. Its math is ``selective.py`` (the A/B split); the
average is ``strategies.aggregation.weighted_mean`` through the transport, as FedAvg's.
"""

from ..spec import StrategySpec
from .client import OWN_B, FedSALoraClient
from .server import FedSALora

SPEC = StrategySpec(  # A's sum; B stays home
    name=FedSALora.name,
    server=FedSALora,
    client=FedSALoraClient,
    adapter="lora",
    dp_refusal=None,
    record_dp_refusal=None,  # A's update is post-processing of the DP-SGD steps (B too, kept on the node)
)

__all__ = ["OWN_B", "SPEC", "FedSALora", "FedSALoraClient"]
