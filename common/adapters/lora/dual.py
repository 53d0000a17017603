"""LoRA with a personal LoRA beside it (``fedavg-dual``): the baseline for SimGrad's LoRA local path.

h = W h + LoRA_global(h) + LoRA_personal(h). The global LoRA (peft's ``default`` adapter, ``lora.*``) is what the
server sends and what is sent back; the personal one (``personal.*``, a second peft adapter beside it) trains each
round and stays in the client's ``ClientState`` (``personal.DualPath``).
"""

from __future__ import annotations

from typing import ClassVar

from ..personal import DualPath
from .adapter import LoraAdapter


class LoraDualAdapter(DualPath, LoraAdapter):
    """A travelling LoRA beside a personal LoRA that never leaves the client (see the module docstring)."""

    name: ClassVar[str] = "lora-dual"
    personal_under: ClassVar[bool] = False
