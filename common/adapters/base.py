"""What every adapter kind is, as a typed protocol, and the per-client state it may keep.

One process serves many clients (Ray actors in simulation, the node's model worker in deployment) on ONE frozen
base model per (model, quantisation, device): an adapter is attached on top of it, and everything that belongs to
one client lives in that client's ``ClientState`` and is swapped into the shared model per message.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from common.section import Section

if TYPE_CHECKING:
    from torch import nn

    from common.config import RunConfig
    from common.data import Example

Arrays = dict[str, np.ndarray]


class OwnStepSection(Section):
    """An adapter section whose few trainable numbers take their own step (``learning-rate``, used instead of
    ``train.learning-rate``) and whose gates may take another (``gate-learning-rate``, 0: the same). Each kind
    declares the two fields with its own bounds; both may differ by base model (``model.overrides``)."""

    learning_rate: float
    gate_learning_rate: float

    def train_overrides(self) -> dict[str, Any]:
        return {"learning_rate": self.learning_rate}

    @property
    def gate_lr_scale(self) -> float:
        """The gates' step as a multiple of the adapter's own (1.0 when ``gate-learning-rate`` is 0)."""
        return self.gate_learning_rate / self.learning_rate if self.gate_learning_rate else 1.0


class UndeclaredStateError(KeyError):
    """A handler touched a client-state key that neither the adapter nor the strategy declared."""


class ClientState:
    """A client's arrays kept between messages, under keys declared up front.

    Backed by Flower's ``context.state`` (a ``RecordDict``): in simulation Flower keeps it per client; in deployment
    the model worker returns exactly these keys to the ClientApp (``client_app.worker``). Reading or writing a key
    that was not declared raises, so state a newcomer forgot to declare fails in every mode, not silently in
    deployment only.
    """

    def __init__(self, record_dict: Any, declared: tuple[str, ...]) -> None:
        self._records = record_dict
        self.declared = tuple(declared)

    def _check(self, key: str) -> None:
        if key not in self.declared:
            raise UndeclaredStateError(f"client state '{key}' is not declared (declared: {list(self.declared)})")

    def get(self, key: str) -> Arrays | None:
        """The arrays kept under ``key``, or None the first time."""
        from common.records import from_array_record

        self._check(key)
        return from_array_record(self._records.array_records[key]) if key in self._records else None

    def put(self, key: str, arrays: Mapping[str, np.ndarray]) -> None:
        from common.records import to_array_record

        self._check(key)
        self._records[key] = to_array_record(dict(arrays))

    def nbytes(self) -> int:
        """Bytes of the arrays this client keeps now (what it costs the SuperNode, or the simulation, per client)."""
        present = [key for key in self.declared if key in self._records]
        return sum(len(array.data) for key in present for array in self._records.array_records[key].values())


class AdapterKind(Protocol):
    """One kind of adapter (LoRA, PQ-LoRA, ...): what arrives, what trains, what is sent, what is kept.

    Class attributes:
        name: the kind's name (strategies name the kind they train).
        section: its run-config section class (``section.key`` is the config prefix, e.g. ``lora``).
        extra_sections: sections of the parts it composes (the dual-path kinds' ``personal.*``).
        state_keys: the ``ClientState`` keys it keeps between messages (empty: the server sends everything).
        reply_metrics: metrics it adds to a train reply, copied into metrics.jsonl (name -> list element type, or
            None for a number).

    An instance is the adapter attached to one shared base model with one run's settings.
    """

    name: ClassVar[str]
    section: ClassVar[type[Section]]
    extra_sections: ClassVar[tuple[type[Section], ...]]
    state_keys: ClassVar[tuple[str, ...]]
    reply_metrics: ClassVar[dict[str, type | None]]
    model: nn.Module  # the base model with this adapter attached: what trains and evaluates
    initial: Arrays  # the client's first adapter: the names and shapes of everything sent and received

    def __init__(self, base: nn.Module, cfg: RunConfig) -> None:
        """Attach to ``base`` (frozen, shared) with the run's settings of this kind."""
        ...

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        """What defines the attached adapter (two clients with the same settings share the attachment)."""
        ...

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        """Swap one client's kept state in, then what the server sent (None: keep the client's own)."""
        ...

    def prepare_training(self, active: list[int] | None) -> None:
        """Make trainable what this round trains (``active``: the blocks a routing strategy chose; None: all)."""
        ...

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        """Trainable parameters that step at another rate than the round's: (parameters, multiple of the round's
        learning rate) per group; None: one rate for everything trainable."""
        ...

    def outgoing(self, active: list[int] | None) -> tuple[Arrays, dict[str, Any]]:
        """What is sent after training, and the adapter's metrics for the reply."""
        ...

    def received(self, active: list[int] | None) -> Arrays:
        """What the server sent this message, in ``outgoing``'s names (the reference to align onto)."""
        ...

    def end(self, state: ClientState) -> None:
        """Keep this client's state after a message."""
        ...

    def disabled(self) -> AbstractContextManager[Any]:
        """Run the pure base model inside the block (a frozen probe)."""
        ...

    def detach(self) -> nn.Module:
        """Remove the adapter; return the base model as it was before ``attach``."""
        ...

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The client's own copy of its final adapter (None: the server's copy is the whole adapter)."""
        ...

    @staticmethod
    def save_server_copy(arrays: Arrays, cfg: RunConfig, base_model_name: str, out_dir: Path) -> Path:
        """Write the server's final arrays of this kind (a PEFT directory where the kind has one)."""
        ...


@runtime_checkable
class ReportsBound(Protocol):
    """An adapter kind that reports a generalisation bound on the client's training data at the end of a run
    (SubLoRA's compression bound): ``bound_*`` metrics of the last evaluation, copied into metrics.jsonl."""

    def final_report(self, tokenizer: Any, examples: list[Example], batch_size: int, max_len: int) -> dict[str, Any]:
        """The bound's metrics (``bound_*`` names) for the adapter attached now."""
        ...
