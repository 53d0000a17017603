"""VEMoE (seed 002, Fed-VEMoE): a federated pool of LoRA experts with token routing, server-oblivious expert
aggregation and open-world expert management.

``routing.py`` (responsibilities from probe losses, the top-m experts) and ``pool.py`` (the constant-length payload,
the experts from its sum, prune / merge / birth) are its math; ``server.py`` and ``client.py`` its two halves, and
``wire.py`` the keys they send each other; ``config.py`` its section (``vemoe.*``). The pool of experts is the
adapter kind ``experts`` (``common.adapters.experts``, ``experts.*``); with ``vemoe.personal-lora`` it is
``experts-dual``, the pool beside a personal LoRA that never leaves the client.
"""

from ..spec import StrategySpec
from .client import VEMoEClient
from .config import VemoeSection
from .server import VEMoE
from .wire import VemoeWire

SPEC = StrategySpec(
    name=VEMoE.name,
    server=VEMoE,
    client=VEMoEClient,
    adapter="experts",
    section=VemoeSection,
    wire=VemoeWire,
    adapter_from=lambda cfg: "experts-dual" if cfg.section(VemoeSection).personal_lora else "experts",
    dp_refusal="each client's payload is its experts weighted by its responsibilities (not an update of bounded "
    "norm), and its birth votes are counted in the clear",
    record_dp_refusal="each client's responsibilities and birth votes are made from probe losses on its records, "
    "outside DP-SGD",
)

__all__ = ["SPEC", "VEMoE", "VEMoEClient", "VemoeSection"]
