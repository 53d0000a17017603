"""FedSA-LoRA's server half: FedAvg of the LoRA A matrices only, per base-model family.

Every client trains a whole LoRA; only its A matrices come back, and the server's new global A of a family is the
example-weighted mean of its members' (``strategies.families``, the grouping FedAvg uses: one group, and in secure
mode one SecAgg+ group of at least 3, per base model). The B matrices stay on the clients (``client.py``), so the
server holds no complete adapter: each client saves its own (global A + its B) at the end, and the server saves
none (``final_adapters``); the global A is in its checkpoint.
"""

from __future__ import annotations

from ..base import Arrays, FinalAdapter
from ..families import FamilyMean
from .selective import shared_part


class FedSALora(FamilyMean):
    """Selective aggregation of LoRA (Guo et al., ICLR 2025): the A matrices averaged, the B matrices private.

    State: ``global`` (one family) or ``global-<model>`` (several) — each family's current global A matrices.
    A round whose group produced no mean (every reply rejected, or too few) keeps the previous A.
    """

    name = "fedsa-lora"

    def shared(self, initial: Arrays) -> Arrays:
        """The A matrices of a client's initial adapter: all that is averaged and travels."""
        return shared_part(initial)

    def final_adapters(self) -> list[FinalAdapter]:
        """None: an A without a B is not an adapter (peft would load B as zero: the base model). Every client
        saves its complete adapter (the global A and its own B) as a PEFT directory under
        ``client-adapters/partition-<id>``; the final global A is the run's last checkpoint."""
        return []
