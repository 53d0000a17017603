"""SimGrad's run-config section (``simgrad.*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from common.adapters.pqlora import PQLoraSection
from common.section import Section

if TYPE_CHECKING:
    from common.config import RunConfig


class SimGradSection(Section):
    """SimGrad relevance aggregation: signatures, relevance softmax, grouping, routing and alignment."""

    key: ClassVar[str] = "simgrad"
    # row softmax of the cosine relevance matrix; below 0.01 the softmax is a hard max, and tiny values gave NaN
    temperature: float = Field(0.3, ge=0.01, le=100, allow_inf_nan=False)
    mixing: Literal["relevance", "uniform", "local-only"] = "relevance"  # uniform / local-only: ablations
    # whether a client's own P/Q is in its global mix (w_ii from S_ii = 1, the largest in the row); false: the
    # softmax runs over the other clients only, so a client's own trained P/Q is replaced every round. True since the
    # few-shot-pairs validation sweep (docs/results/sweep-simgrad-few-shot-pairs): a client whose signature is unlike
    # everyone's keeps most of its own P/Q, and the XSum clients stopped paying for the sharing
    mix_self: bool = True
    probe_model: str = Field("smollm2-135m-instruct", min_length=1)  # the small frozen model every client probes
    probe_examples: int = Field(8, ge=1)
    sketch_buckets: int = Field(8, ge=1, le=4096)  # rows of the count-sketched lm_head gradient
    ema_decay: float = Field(0.4, ge=0, lt=1)
    noise_scale: float = Field(0.05, ge=0)  # Gaussian noise std, relative to the signature's RMS
    keep_fraction: float = Field(0.6, gt=0, le=1)  # random subsample of signature coordinates kept
    route_budget: int = Field(0, ge=0)  # blocks trained and sent per round (0: all; the sweep preferred all)
    alignment: bool = True  # Procrustes-align the outgoing P/Q onto the received global ones
    anchors: int = Field(64, ge=2)
    min_group_size: int = Field(3, ge=3)  # secure mode: SecAgg+ groups by relevance, never smaller than this
    # The local path of h = W h + (1 - beta) h_L + beta h_G. "pq": the seeds' form (P_L/Q_L train and travel, the
    # received P_G/Q_G is mixed in). "lora": a personal LoRA (``personal.*``, every block) that never travels, beside
    # one PQ path that starts from the received P_G/Q_G, trains and travels (``common.adapters.pqlora.dual``).
    # Default "lora" with PQ lr 0.03 (few-shot-pairs validation sweep, docs/comparing.md "Results"): the seeds' "pq"
    # form ended above local-only on most clients where a client has no task partner.
    local_path: Literal["pq", "lora"] = "lora"

    def check(self, cfg: RunConfig) -> None:
        blocks = cfg.section(PQLoraSection).blocks
        if self.route_budget > blocks:
            raise ValueError(f"simgrad.route-budget: {self.route_budget} exceeds pqlora.blocks={blocks}")
