"""Local-only training (``strategy = "local"``): the baseline. No adapter is aggregated; each client trains and
keeps its own, of the kind ``local.adapter`` names (LoRA to compare with FedAvg, PQ-LoRA with SimGrad)."""

from ..spec import StrategySpec
from .client import LocalClient
from .config import LocalSection
from .server import LocalOnly

SPEC = StrategySpec(
    name=LocalOnly.name,
    server=LocalOnly,
    client=LocalClient,
    adapter="lora",
    section=LocalSection,
    adapter_from=lambda cfg: cfg.section(LocalSection).adapter,
    dp_refusal="local-only training sends no adapter: there is nothing to privatise (run it without dp.mode)",
    record_dp_refusal=None,  # it sends nothing; its DP-SGD adapter is the baseline a private federation is held to
)

__all__ = ["SPEC", "LocalClient", "LocalOnly", "LocalSection"]
