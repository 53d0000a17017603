"""FedAvg over LoRA adapters: the baseline every other strategy is compared with.

The new global adapter is the example-weighted mean of the clients' trained adapters (McMahan et al., 2017). In a
federation of different base models, LoRA's A and B have model-specific shapes, so FedAvg can only average
within a model family: one group (and one global adapter) per base model (``strategies.families``, shared with
FedSA-LoRA). In secure mode the server learns only each family's mean (through SecAgg+), never one client's adapter.
"""

from __future__ import annotations

from ..base import FinalAdapter
from ..families import FamilyMean, family_key

__all__ = ["FedAvg", "FedAvgDual", "family_key"]  # family_key: re-exported (it lives in strategies.families)


class FedAvg(FamilyMean):
    """Federated averaging of the full LoRA adapter, one group per base model.

    State: ``global`` (one family) or ``global-<model>`` (several) — the current global adapter of each family.
    A round whose group produced no mean (every reply rejected, or too few) keeps the previous adapter.
    """

    name = "fedavg"

    def final_adapters(self) -> list[FinalAdapter]:
        single = len(self.global_arrays) == 1
        return [
            FinalAdapter("" if single else family, self.model_of_family.get(family, family), arrays)
            for family, arrays in self.global_arrays.items()
        ]


class FedAvgDual(FedAvg):
    """FedAvg of the global LoRA of a dual-path adapter (``lora-dual``), one group per base model.

    Each client also trains a personal LoRA (``personal.*``) that stays in its node state and is never sent: the
    server's view, in plain and secure mode, is FedAvg's. The baseline a personalised strategy (SimGrad with
    ``simgrad.local-path = "lora"``) has to beat with the same local path.
    """

    name = "fedavg-dual"
