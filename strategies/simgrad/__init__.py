"""SimGrad (FedMosaic): relevance-weighted, personalised PQ-LoRA aggregation across heterogeneous clients.

``relevance.py`` (server math) and ``signatures.py`` (client math) are pure functions; ``server.py`` and
``client.py`` are its two halves, and ``wire.py`` the keys they send each other; ``config.py`` its section
(``simgrad.*``); ``plots.py`` its figures.
"""

from ..spec import StrategySpec
from .client import SimGradClient
from .config import SimGradSection
from .server import ClientReport, SimGrad
from .wire import SimGradWire

SPEC = StrategySpec(
    name=SimGrad.name,
    server=SimGrad,
    client=SimGradClient,
    adapter="pqlora",
    section=SimGradSection,
    wire=SimGradWire,
    adapter_from=lambda cfg: "pqlora-dual" if cfg.section(SimGradSection).local_path == "lora" else "pqlora",
    dp_refusal="each client's gradient signature and block salience (the routing is made from them) are sent in "
    "the clear, unaccounted",
    record_dp_refusal="each client's gradient signature and block salience are made from raw gradients on its "
    "records, outside DP-SGD",
    guarded_by_default=True,  # its shared adapter can leave a member worse than training alone
)

__all__ = ["SPEC", "ClientReport", "SimGrad", "SimGradClient", "SimGradSection"]
