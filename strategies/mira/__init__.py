"""MIRA: personal LoRA adapters and a graph-Laplacian step over task-fingerprint neighbours (seed 003, phase 4).

``laplacian.py`` is its math (pure functions); ``server.py`` and ``client.py`` its two halves (the fingerprint
report is shared with ATLAS: ``strategies.fingerprint``); ``config.py`` its section (``mira.*``); ``plots.py`` its
adjacency heatmaps.
"""

from ..fingerprint import FingerprintSection
from ..registry import StrategySpec
from .client import MiraClient
from .config import MiraSection
from .server import Mira

SPEC = StrategySpec(
    name=Mira.name,
    server=Mira,
    client=MiraClient,
    adapter="lora",
    section=MiraSection,
    shared_sections=(FingerprintSection,),
)

__all__ = ["SPEC", "Mira", "MiraClient", "MiraSection"]
