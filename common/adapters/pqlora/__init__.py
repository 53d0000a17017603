"""PQ-LoRA (FedMosaic): frozen seeded orthogonal A/B, trainable width-independent r x r P and r-vector Q.

Laid out like peft's ``tuners/lora``: ``config`` (what), ``layer`` (per-layer math), ``model`` (surgery and I/O);
``adapter`` the adapter kind a client trains; ``alignment`` the data-free Procrustes alignment of P/Q (pure numpy).
"""

from .adapter import PQLoraAdapter
from .alignment import align_arrays, align_pq, procrustes_rotation, synthetic_anchors
from .config import PQLoraConfig, PQLoraSection
from .layer import PQLoraGates, PQLoraLinear, derive_seed, seeded_orthonormal
from .model import (
    adapters_disabled,
    attach_pqlora,
    block_grad_norms,
    detach_pqlora,
    find_decoder_blocks,
    get_gates,
    get_local_state,
    get_pq_arrays,
    load_pq_adapter,
    pq_num_floats,
    reset_local_state,
    save_pq_adapter,
    set_local_state,
    set_pq_arrays,
    set_trainable_blocks,
)

__all__ = [
    "PQLoraAdapter",
    "PQLoraConfig",
    "PQLoraSection",
    "PQLoraGates",
    "PQLoraLinear",
    "adapters_disabled",
    "align_arrays",
    "align_pq",
    "attach_pqlora",
    "block_grad_norms",
    "derive_seed",
    "detach_pqlora",
    "find_decoder_blocks",
    "get_gates",
    "get_local_state",
    "get_pq_arrays",
    "load_pq_adapter",
    "pq_num_floats",
    "procrustes_rotation",
    "reset_local_state",
    "save_pq_adapter",
    "seeded_orthonormal",
    "set_local_state",
    "set_pq_arrays",
    "set_trainable_blocks",
    "synthetic_anchors",
]
