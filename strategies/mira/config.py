"""MIRA's run-config section (``mira.*``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from common.section import Section

from ..fingerprint.laplacian import alpha_for, parse_alpha


class MiraSection(Section):
    """MIRA: every client keeps its own LoRA; after local training the server's graph-Laplacian step pulls it
    toward its neighbours, W_k <- W_k - eta sum_l a_kl (W_k - W_l), a_kl = exp(-alpha ||f_k - f_l||^2) row-normalised
    over the clients' task fingerprints (``fingerprint.*``)."""

    key: ClassVar[str] = "mira"
    # RBF bandwidth over the PCA-reduced fingerprints; "median": 1 / median pairwise squared distance
    alpha: float | Literal["median"] = "median"
    eta: float = Field(0.1, ge=0, le=1, allow_inf_nan=False)  # 0: local-only training; 1: the neighbours' mean
    refresh_every: int = Field(0, ge=0)  # new fingerprints (and adjacency) every N rounds; 0: once, in round 1
    min_group_size: int = Field(3, ge=3)  # secure mode: SecAgg+ groups of the adjacency graph, never smaller
    # A personal LoRA (``personal.*``) beside the stepped one, trained every round and never sent or stepped
    # (``lora-dual``, as fedavg-dual); fingerprints are taken without it.
    personal_lora: bool = False

    _alpha = field_validator("alpha", mode="before")(parse_alpha)

    def alpha_for(self, median: float) -> float:
        return alpha_for(self.alpha, median)
