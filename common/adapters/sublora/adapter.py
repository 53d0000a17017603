"""The SubLoRA adapter kind on a shared base model: alpha (and the gates) is all that arrives, trains and travels.

Every client builds theta_0 and P from ``sublora.seed``, so the server's alpha means the same adapter everywhere;
averaging alpha is averaging theta (the map is linear), which is why FedAvg, SecAgg+ and local-only carry it
unchanged. Nothing is kept between messages (local-only keeps the arrays itself). At the end a client exports
theta_0 + P alpha as a PEFT LoRA directory, and ``final_report`` computes the compression bound on its training data.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from ..base import AdapterBase, Arrays
from . import bound
from .config import SubLoraSection
from .model import (
    ALPHA,
    GATES,
    attach_sublora,
    detach_sublora,
    get_arrays,
    save_materialised,
    set_arrays,
    sublora_disabled,
    subspace_of,
    trainable,
)

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig, Section
    from common.data import Example


class SubLoraAdapter(AdapterBase):
    """SubLoRA (``common.adapters.sublora``): LoRA trained through ``sublora.intrinsic-dim`` numbers."""

    name: ClassVar[str] = "sublora"
    section: ClassVar[type[Section]] = SubLoraSection
    missing: ClassVar[str] = "SubLoRA keeps nothing between messages: the server (or the strategy) must give alpha"

    def attach(self, base: nn.Module, cfg: RunConfig) -> nn.Module:
        self.sub = cfg.section(SubLoraSection)
        return attach_sublora(base, self.sub)

    def arrays(self) -> Arrays:
        """alpha (and the gates); ``initial``: zeros, theta_0, the base model's function."""
        return get_arrays(self.model)

    def load(self, arrays: Arrays) -> None:
        set_arrays(self.model, arrays)

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        return cfg.section(SubLoraSection).model_dump_json()

    def prepare_training(self) -> None:
        """alpha (and the gates) train; nothing else does."""
        trainable(self.model)

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        """learned mode with ``sublora.gate-learning-rate``: the gates step at their own rate."""
        subspace = subspace_of(self.model)
        if subspace.gates is None or self.sub.gate_lr_scale == 1.0:
            return None
        return [([subspace.alpha], 1.0), ([subspace.gates], self.sub.gate_lr_scale)]

    def disabled(self) -> AbstractContextManager[Any]:
        return sublora_disabled(self.model)

    def detach(self) -> nn.Module:
        return detach_sublora(self.model)

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The client's export: theta_0 + P alpha as a PEFT LoRA directory (the server holds only alpha)."""
        return save_materialised(self.model, self.sub, base_model_name, out_dir)

    @staticmethod
    def save_server_copy(arrays: Arrays, cfg: RunConfig, base_model_name: str, out_dir: Path) -> Path:
        """The server has no base model to materialise with: alpha (and the gates) and the settings that rebuild
        P; every client exports the PEFT directory (``save``)."""
        out = AdapterBase.save_server_copy(arrays, cfg, base_model_name, out_dir)
        (out / "sublora.json").write_text(cfg.section(SubLoraSection).model_dump_json(by_alias=True, indent=1))
        return out

    def final_report(self, tokenizer: Any, examples: list[Example], batch_size: int, max_len: int) -> dict[str, Any]:
        """The compression bound on ``examples`` (the client's training data) with alpha quantised and coded (see
        ``bound``): ``bound_*`` metrics. The coding is checked to decode to the same indices; alpha is restored."""
        from common.evaluation import example_token_stats

        examples = examples[: self.sub.bound_examples or None]
        arrays = get_arrays(self.model)
        codebook, indices = bound.quantise(arrays[ALPHA], self.sub.quant_levels, seed=self.sub.seed)
        words, counts = bound.encode(indices, len(codebook))
        if not np.array_equal(bound.decode(words, counts), indices):
            raise RuntimeError("sublora bound: the arithmetic code does not decode to alpha's indices")
        gates = len(arrays.get(GATES, []))
        bits = bound.code_length(len(indices), len(codebook), words, num_gates=gates)
        smoothing = self.sub.bound_smoothing
        full = example_token_stats(self.model, tokenizer, examples, batch_size, max_len, smoothing)
        try:
            set_arrays(self.model, {**arrays, ALPHA: codebook[indices]})
            quantised = example_token_stats(self.model, tokenizer, examples, batch_size, max_len, smoothing)
        finally:
            set_arrays(self.model, arrays)
        vocab = int(cast(Any, self.model).config.vocab_size)  # the width of the predictions the smoothing mixes with
        result = bound.bounds(bits, quantised, vocab, smoothing, self.sub.bound_delta)
        return {
            "bound_code_bits": result.code_bits,
            "bound_raw_bits": 32 * (len(indices) + gates),
            "bound_examples": result.examples,
            "bound_train_bits_per_token": result.train_bits_per_token,
            "bound_train_bits_per_token_unquantised": bound.empirical_risk(full)[0],
            "bound_train_top1_error": result.train_top1_error,
            "bound_bits_per_token": result.bits_per_token,
            "bound_top1_error": result.top1_error,
            "bound_max_bits": result.max_bits,
        }
