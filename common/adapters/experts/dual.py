"""The expert pool with a personal LoRA beside it (VEMoE with ``vemoe.personal-lora = true``).

h = W h + LoRA_personal(h) + sum_k alpha_tk expert_k(h): the personal LoRA (``personal.*``) trains every round and
stays in the client's ``ClientState`` (``personal.DualPath``); the pool is what travels, with the same wire names as
the plain pool (the server cannot tell the two apart). Why: with the pool alone, each expert is a
responsibility-weighted average over clients of several tasks, which is at least as much mixing as FedAvg
(docs/strategies/vemoe.md); a personal path keeps what is the client's own out of the experts, as fedavg-dual's does
for FedAvg.
"""

from __future__ import annotations

from typing import ClassVar

from ..personal import DualPath
from .adapter import ExpertsAdapter


class ExpertsDualAdapter(DualPath, ExpertsAdapter):
    """A travelling pool of LoRA experts beside a personal LoRA that never leaves the client (module docstring)."""

    name: ClassVar[str] = "experts-dual"
