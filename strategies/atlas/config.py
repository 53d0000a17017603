"""ATLAS's run-config section (``atlas.*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from common.config import Section

if TYPE_CHECKING:
    from common.config import RunConfig


class AtlasSection(Section):
    """ATLAS: clients clustered by task fingerprint (``fingerprint.*``), FedAvg strictly inside each cluster."""

    key: ClassVar[str] = "atlas"
    # fingerprint: k-means on the PCA-reduced fingerprints; oracle: one cluster per task set (seed 003's baseline)
    clustering: Literal["fingerprint", "oracle"] = "fingerprint"
    k: int = Field(0, ge=0)  # 0: chosen by the combined silhouette / Davies-Bouldin / Calinski-Harabasz score
    k_max: int = Field(6, ge=2)  # largest k tried (and at most clients - 1)
    recluster_every: int = Field(0, ge=0)  # new fingerprints and clusters every N rounds; 0: once, in round 1
    min_group_size: int = Field(3, ge=3)  # secure mode: a smaller cluster merges into its nearest one

    def check(self, cfg: RunConfig) -> None:
        if self.k and self.k > self.k_max:
            raise ValueError(f"atlas.k: {self.k} exceeds atlas.k-max={self.k_max}")
