"""SubLoRA (seed 004): LoRA whose parameters live in a random subspace, theta = theta_0 + P alpha, so a client trains
and sends only alpha (d numbers). Laid out like peft's ``tuners/lora``: ``config`` (what), ``projection`` (P),
``allocation`` (how alpha is shared between A and B), ``layer`` (per-layer math and the subspace), ``model``
(surgery, arrays, PEFT export), ``adapter`` (the kind a client trains), ``bound`` (the compression bound)."""

from .adapter import SubLoraAdapter
from .config import SubLoraSection
from .layer import Subspace, SubspaceLoraLinear
from .model import attach_sublora, detach_sublora, get_arrays, materialise, set_arrays, sublora_disabled
from .projection import DenseProjection, FastfoodProjection, make_projection

__all__ = [
    "DenseProjection",
    "FastfoodProjection",
    "SubLoraAdapter",
    "SubLoraSection",
    "Subspace",
    "SubspaceLoraLinear",
    "attach_sublora",
    "detach_sublora",
    "get_arrays",
    "make_projection",
    "materialise",
    "set_arrays",
    "sublora_disabled",
]
