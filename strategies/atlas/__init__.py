"""ATLAS: task clusters from gradient fingerprints and FedAvg strictly inside each cluster (seed 003, phases 1-3).

``clustering.py`` (clusters and groups), ``ranks.py`` (per-layer ranks; ``RankPlan`` keeps who has which) and
``neighbours.py`` (the MIRA step inside the clusters) are its math (pure functions); ``server.py`` its server half,
``client.py`` its client half (on the shared fingerprint report: ``strategies.fingerprint``) and ``wire.py`` the
names the two halves send each other; ``config.py`` its section (``atlas.*``); ``plots.py`` its figures.
"""

from ..fingerprint import FingerprintSection
from ..spec import StrategySpec
from .client import AtlasClient
from .config import AtlasSection
from .server import Atlas
from .wire import AtlasWire

SPEC = StrategySpec(
    name=Atlas.name,
    server=Atlas,
    client=AtlasClient,
    adapter="lora",
    adapter_from=lambda cfg: "lora-dual" if cfg.section(AtlasSection).personal_lora else "lora",
    section=AtlasSection,
    wire=AtlasWire,
    shared_sections=(FingerprintSection,),
    dp_refusal="each client's fingerprint (the clusters are made from it) is sent in the clear, unaccounted",
    record_dp_refusal="each client's fingerprint is made from raw gradients on its records, outside DP-SGD",
    guarded_by_default=True,  # its shared adapter can leave a member worse than training alone
)

__all__ = ["SPEC", "Atlas", "AtlasClient", "AtlasSection"]
