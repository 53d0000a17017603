"""The task-fingerprint run-config section (``fingerprint.*``), shared by the strategies that cluster clients by
task (ATLAS) or connect them by task similarity (MIRA)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from common.section import Section


class FingerprintSection(Section):
    """How a client computes the task fingerprint it reports (seed 003, phase 1).

    The fingerprint is the gradient of the answer loss with respect to the adapter's parameters in the last
    ``blocks`` decoder blocks, summed over ``batches`` batches of the client's training data, each adapted layer's
    gradient L2-normalised, concatenated and count-sketched to ``sketch-dim`` numbers with a seed every client
    shares. The server reduces the clients' sketches to ``dim`` numbers by PCA.
    """

    key: ClassVar[str] = "fingerprint"
    # seed 003 went from 10 to 64 for a stable signal; measured in docs/strategies/atlas-mira.md
    batches: int = Field(16, ge=1, le=1024)
    blocks: int = Field(2, ge=1)  # the last N decoder blocks (seed 003: the last two)
    sketch_dim: int = Field(512, ge=8, le=1 << 16)  # what leaves the client
    dim: int = Field(64, ge=2, le=4096)  # PCA on the server (at most clients - 1 components)
    # Sanitisation, as SimGrad's signatures (relative noise, EMA across rounds, coordinate subsampling). Off by
    # default: clustering needs the sketch's geometry, and the sketch of a 2-block gradient says little about one
    # example (docs/strategies/atlas-mira.md, "what the server learns").
    ema_decay: float = Field(0.0, ge=0, lt=1)
    noise_scale: float = Field(0.0, ge=0)
    keep_fraction: float = Field(1.0, gt=0, le=1)
