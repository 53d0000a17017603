"""MIRA: personal LoRA adapters and a graph-Laplacian step over task-fingerprint neighbours (seed 003, phase 4).

``server.py`` and ``client.py`` are its two halves and ``config.py`` its section (``mira.*``). What it shares with
ATLAS lives in ``strategies.fingerprint``: the report, its math (``laplacian.py``: the RBF adjacency and the
Laplacian step, pure functions) and the adjacency heatmaps (``plots.py``).
"""

from ..fingerprint import FingerprintSection
from ..spec import StrategySpec
from .client import MiraClient
from .config import MiraSection
from .server import Mira

SPEC = StrategySpec(
    name=Mira.name,
    server=Mira,
    client=MiraClient,
    adapter="lora",
    adapter_from=lambda cfg: "lora-dual" if cfg.section(MiraSection).personal_lora else "lora",
    section=MiraSection,
    shared_sections=(FingerprintSection,),
    dp_refusal="each client's fingerprint (the task graph is made from it) is sent in the clear, unaccounted",
    record_dp_refusal="each client's fingerprint is made from raw gradients on its records, outside DP-SGD",
    guarded_by_default=True,  # its shared adapter can leave a member worse than training alone
)

__all__ = ["SPEC", "Mira", "MiraClient", "MiraSection"]
