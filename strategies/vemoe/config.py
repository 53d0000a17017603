"""VEMoE's run-config section (``vemoe.*``): how many experts start, how clients measure their responsibilities, and
when the server gives birth to, prunes or merges an expert. The pool itself (slots, rank, routing) is the adapter's
section, ``experts.*`` (``common.adapters.experts``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator

from common.adapters.experts import ExpertsSection
from common.section import Section, split_pairs

if TYPE_CHECKING:
    from common.config import RunConfig


class VemoeSection(Section):
    """VEMoE (seed 002): responsibilities from probe losses, one secure sum for every expert, open-world pool."""

    key: ClassVar[str] = "vemoe"
    k_init: int = Field(3, ge=1)  # live experts in round 1 (at most experts.k-max; seed 002 runs 3)
    probe_examples: int = Field(4, ge=1)  # a client's probe batch: each live expert's loss on it gives r
    temperature: float = Field(0.5, gt=0, allow_inf_nan=False)  # r = softmax(-probe loss / temperature)
    # "summed": the posterior r_k ~ prior_k x p(probe | expert k), from the probe's SUMMED log-likelihood (10-80
    # answer tokens: 5-40 times sharper than the mean), the prior the pool's share of last round's responsibility
    # (counted by the server; uniform in round 1); "mean": r from the probe's mean answer-token loss and
    # ``temperature`` (seed 002's). With "gradient" below and the personal LoRA, the default since 2026-11-29, chosen
    # by bench.defaults' rule on three structures (docs/results/defaults-vemoe)
    likelihood: Literal["mean", "summed"] = "summed"
    # round 1, where every expert still computes the base model and the probe losses tie: "gradient": r from each
    # expert's first-order gain on the probe (its squared gradient in B), which follows the client's data; "spread":
    # the tie broken in a per-client order (clients spread over the experts at random, the categories mixed)
    first_round: Literal["spread", "gradient"] = "gradient"
    # the oracle run: a client whose task set is named here routes to that expert slot alone (one-hot r), so each
    # category has its own expert by hand ("question generation=0,answer generation=1"): what routing could win
    oracle: dict[str, int] = Field(default_factory=dict)
    # a client votes for a new expert when its best expert's probe loss is above this multiple of the best it has
    # seen in earlier rounds: the pool has drifted away from it (relative, since losses differ by task)
    birth_threshold: float = Field(1.05, gt=1, allow_inf_nan=False)
    birth_min_votes: int = Field(2, ge=1)  # votes a birth needs (a free slot too)
    # > 0: a client also votes when no expert serves it distinctively: the entropy of its r above this share of the
    # uniform's (a client whose category has no expert of its own); 0: off (only drift votes)
    birth_spread: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    prune_threshold: float = Field(0.05, ge=0, lt=1, allow_inf_nan=False)  # share of the round's responsibility
    prune_patience: int = Field(2, ge=1)  # rounds below prune-threshold before the slot is freed
    merge_threshold: float = Field(0.95, gt=0, le=1, allow_inf_nan=False)  # cosine of delta-W above which two merge
    # > 0: two experts also merge when their functional distance on the clients' probes is below this: their probe
    # losses differ, summed over clients, by less than this share of how far each moved them from the base model
    # (scale-free whatever each slot's random A: measured delta-W cosines are 0.01-0.1 whether two experts serve one
    # category or different ones; the distance is about 1 between experts of different categories). 0: off
    merge_distance: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    # a personal LoRA (``personal.*``) beside the pool, trained every round and never sent (adapter kind
    # ``experts-dual``): what is the client's own stays out of the experts, which are averaged across clients (without
    # it every client of ni-categories did worse than training alone, even with each category routed to its own
    # expert by hand). On by default since 2026-11-29, chosen by bench.defaults' rule on three structures
    # (docs/results/defaults-vemoe)
    personal_lora: bool = True
    baseline_run: str = ""  # a local-only run dir on the same clients: negative_transfer.png against it ("": none)

    _pairs = field_validator("oracle", mode="before")(split_pairs)

    def check(self, cfg: RunConfig) -> None:
        pool = cfg.section(ExpertsSection)
        if self.k_init > pool.k_max:
            raise ValueError(f"vemoe.k-init: {self.k_init} exceeds experts.k-max={pool.k_max}")
        if outside := {t: s for t, s in self.oracle.items() if not 0 <= s < self.k_init}:
            raise ValueError(f"vemoe.oracle: slots {outside} are not among the {self.k_init} experts of round 1")
        if cfg.robust.clip_norm:  # the payload is r * theta, not an update of the pool the norm is measured from
            raise ValueError(
                "robust.clip-norm: VEMoE's payload is each expert weighted by the client's responsibility, not an "
                "update of the pool it started from, so clipping its distance to the pool would change the weights; "
                "leave it 0 (robust.max-update-norm still refuses a reply that is too far)"
            )
