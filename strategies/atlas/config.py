"""ATLAS's run-config section (``atlas.*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from common.section import Section, split_csv

from ..fingerprint.laplacian import alpha_for, parse_alpha

if TYPE_CHECKING:
    from common.config import RunConfig


class AtlasSection(Section):
    """ATLAS: clients clustered by task fingerprint (``fingerprint.*``), FedAvg strictly inside each cluster."""

    key: ClassVar[str] = "atlas"
    # fingerprint: k-means on the PCA-reduced fingerprints; oracle: one cluster per task set (seed 003's baseline)
    clustering: Literal["fingerprint", "oracle"] = "fingerprint"
    k: int = Field(0, ge=0)  # 0: chosen by the combined silhouette / Davies-Bouldin / Calinski-Harabasz score
    k_max: int = Field(6, ge=2)  # largest k tried (and at most clients - 1)
    # a k that leaves a cluster smaller than this is not chosen while another k does not (1: any clustering). 1 by
    # default, chosen on the validation split of three structures (bench.defaults; docs/results/defaults-atlas-min-
    # cluster-size): 2 put the two partner-less clients of few-shot-partnerless in one cluster (+0.183 on the worst
    # client against training alone); 1 cost no preset's worst client anything (it gave up few-shot-pairs' -0.016)
    min_cluster_size: int = Field(1, ge=1)
    recluster_every: int = Field(0, ge=0)  # new fingerprints and clusters every N rounds; 0: once, in round 1
    min_group_size: int = Field(3, ge=3)  # secure mode: a smaller cluster merges into its nearest one
    # Per-layer LoRA ranks under each client's memory budget (MiB of adapter training memory: fp32 weights,
    # gradients and AdamW moments). A node's node-config ``memory-mb`` wins; in simulation this list is cycled over
    # the partitions. Neither: every layer keeps lora.r.
    memory_mb: list[float] = Field(default_factory=list)
    ranks: list[int] = Field(default_factory=lambda: [4, 8, 16, 32, 64], min_length=1)  # seed 003's candidates
    # MIRA inside the clusters (seed 003, phase 4): > 0 gives every client its own adapter, stepped after training
    # toward its same-cluster neighbours, W_k <- (1 - eta) W_k + eta sum_l a_kl W_l (a_kl: RBF of the fingerprints,
    # ``laplacian-alpha`` as ``mira.alpha``, zero across clusters); 0: plain FedAvg inside each cluster.
    laplacian_eta: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    laplacian_alpha: float | Literal["median"] = "median"
    # A personal LoRA (``personal.*``) beside the cluster's, trained every round and never sent (``lora-dual``, as
    # fedavg-dual): a client put with the wrong partners still learns its own task. Fingerprints are taken without it.
    personal_lora: bool = False

    _csv = field_validator("memory_mb", "ranks", mode="before")(split_csv)
    _alpha = field_validator("laplacian_alpha", mode="before")(parse_alpha)

    def alpha_for(self, median: float) -> float:
        return alpha_for(self.laplacian_alpha, median)

    @field_validator("memory_mb")
    @classmethod
    def _positive(cls, value: list[float]) -> list[float]:
        if any(not 0 < v < float("inf") for v in value):
            raise ValueError(f"budgets must be positive numbers of MiB, got {value}")
        return value

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, value: list[int]) -> list[int]:
        if any(not 1 <= r <= 256 for r in value):
            raise ValueError(f"ranks must be 1..256, got {value}")
        return sorted(set(value))

    def budget(self, partition_id: int, node_config: dict[str, Any]) -> float | None:
        """A client's memory budget: node-config ``memory-mb``, else this list cycled, else None (ranks off)."""
        if "memory-mb" in node_config:
            value = node_config["memory-mb"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"node-config memory-mb: expected a positive number of MiB (got {value!r})")
            return float(value)
        return self.memory_mb[partition_id % len(self.memory_mb)] if self.memory_mb else None

    def check(self, cfg: RunConfig) -> None:
        if self.k and self.k > self.k_max:
            raise ValueError(f"atlas.k: {self.k} exceeds atlas.k-max={self.k_max}")
