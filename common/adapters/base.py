"""What every adapter kind is (the typed protocol ``AdapterKind``), the defaults every kind inherits
(``AdapterBase``), and the per-client state a kind may keep.

One process serves many clients (Ray actors in simulation, the node's model worker in deployment) on ONE frozen
base model per (model, quantisation, device): an adapter is attached on top of it, and everything that belongs to
one client lives in that client's ``ClientState`` and is swapped into the shared model per message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
        keeps_adapter: whether those keys hold the client's whole adapter, so that ``begin(state, None)`` resumes it
            (PQ-LoRA); False: the server or the strategy gives the adapter every message.
        reply_metrics: metrics it adds to a train reply, copied into metrics.jsonl (name -> list element type, or
            None for a number).

    An instance is the adapter attached to one shared base model with one run's settings.
    """

    name: ClassVar[str]
    section: ClassVar[type[Section]]
    extra_sections: ClassVar[tuple[type[Section], ...]]
    state_keys: ClassVar[tuple[str, ...]]
    keeps_adapter: ClassVar[bool]
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

    def prepare_training(self) -> None:
        """Make trainable what this round trains."""
        ...

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        """Trainable parameters that step at another rate than the round's: (parameters, multiple of the round's
        learning rate) per group; None: one rate for everything trainable."""
        ...

    def outgoing(self) -> tuple[Arrays, dict[str, Any]]:
        """What is sent after training, and the adapter's metrics for the reply."""
        ...

    def received(self) -> Arrays:
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


class AdapterBase(ABC):
    """The defaults every adapter kind inherits, as peft's ``BaseTuner`` gives its tuners theirs; the kinds subclass
    it and so implement ``AdapterKind``.

    A kind sets ``name`` and ``section``, attaches itself (``attach``), reads and writes what travels (``arrays``,
    ``load``), and says how it is switched off and removed (``disabled``, ``detach``); it overrides only what differs
    from these defaults, which are those of a kind whose whole adapter the server sends every message: no extra
    sections, client state (so ``keeps_adapter`` is False) or reply metrics; ``settings`` is its section and the
    run's seed; ``begin`` loads what arrived (which must be something); everything attached trains, at the round's
    rate; what is sent is the adapter as trained; nothing is kept after a message; the server's copy is the whole
    adapter (``save`` returns None; ``save_server_copy`` writes the named arrays).

    Attributes:
        missing: the error when a message brings no adapter (``begin`` with ``received`` None).
    """

    name: ClassVar[str]
    section: ClassVar[type[Section]]
    extra_sections: ClassVar[tuple[type[Section], ...]] = ()
    state_keys: ClassVar[tuple[str, ...]] = ()
    keeps_adapter: ClassVar[bool] = False
    reply_metrics: ClassVar[dict[str, type | None]] = {}
    missing: ClassVar[str] = "this adapter kind keeps nothing between messages: the server must send it"
    model: nn.Module
    initial: Arrays

    def __init__(self, base: nn.Module, cfg: RunConfig) -> None:
        self.model = self.attach(base, cfg)
        self.initial = self.arrays()
        self._received: Arrays = self.initial

    @abstractmethod
    def attach(self, base: nn.Module, cfg: RunConfig) -> nn.Module:
        """``base`` with this kind attached with the run's settings (what becomes ``model``)."""
        raise NotImplementedError

    @abstractmethod
    def arrays(self) -> Arrays:
        """What travels, as the attached adapter holds it now (``initial`` right after ``attach``)."""
        raise NotImplementedError

    def load(self, arrays: Arrays) -> None:
        """Write what the server sent into the attached adapter (a kind whose ``begin`` is its own needs none)."""
        raise NotImplementedError(f"adapter kind '{self.name}' loads what arrives in its own begin")

    @abstractmethod
    def disabled(self) -> AbstractContextManager[Any]:
        """Run the pure base model inside the block (a frozen probe)."""
        raise NotImplementedError

    @abstractmethod
    def detach(self) -> nn.Module:
        """Remove the adapter; return the base model as it was before ``attach``."""
        raise NotImplementedError

    @classmethod
    def settings(cls, cfg: RunConfig) -> str:
        """The kind's section and the run's seed."""
        return f"{cfg.section(cls.section).model_dump_json()} seed={cfg.seed}"

    def begin(self, state: ClientState, received: Arrays | None) -> None:
        """Load what the server (or the strategy) sent; the kind keeps nothing of its own."""
        if received is None:  # the shared model holds whichever client ran last: never train from that
            raise ValueError(self.missing)
        self.load(received)
        self._received = received

    def prepare_training(self) -> None:  # noqa: B027 (a default that does nothing, not an abstract method)
        """Everything attached trains."""

    def lr_groups(self) -> list[tuple[list[nn.Parameter], float]] | None:
        """One rate for everything trainable."""
        return None

    def regroup(self, groups: list[tuple[list[nn.Parameter], float]]) -> list[tuple[list[nn.Parameter], float]]:
        """``groups`` with the parameters this kind steps at a rate of its own moved into groups of their own (for
        a path composed with it: the personal LoRA); default: as they are."""
        return groups

    def outgoing(self) -> tuple[Arrays, dict[str, Any]]:
        """The adapter as trained, no metrics."""
        return self.arrays(), {}

    def received(self) -> Arrays:
        """What the last ``begin`` loaded (``initial`` before any)."""
        return self._received

    def end(self, state: ClientState) -> None:  # noqa: B027 (a default that does nothing, not an abstract method)
        """Nothing client-local to keep."""

    def save(self, out_dir: Path, base_model_name: str) -> Path | None:
        """The server's copy is the whole adapter (``save_server_copy``)."""
        return None

    @staticmethod
    def save_server_copy(arrays: Arrays, cfg: RunConfig, base_model_name: str, out_dir: Path) -> Path:
        """Named arrays (the client saves whatever more its adapter is)."""
        from common.records import save_arrays

        return save_arrays(arrays, out_dir)


def checked_kind(kind: type[AdapterBase]) -> type[AdapterBase]:
    """``kind`` once it defines what its base leaves to it, else TypeError naming the method, when the kind is
    registered (``ADAPTER_KINDS``) rather than on a client mid-run: a name, every abstract method, and ``load``
    unless it has a ``begin`` of its own (the default ``begin`` loads what the server sent with it)."""
    missing = sorted(getattr(kind, "__abstractmethods__", ()))
    if not isinstance(getattr(kind, "name", None), str) or not kind.name:
        missing.insert(0, "name")
    if kind.begin is AdapterBase.begin and kind.load is AdapterBase.load:
        missing.append("load (or a begin of its own)")
    if missing:
        raise TypeError(f"adapter kind {kind.__name__}: define {', '.join(missing)}")
    return kind


@runtime_checkable
class ReportsBound(Protocol):
    """An adapter kind that reports a generalisation bound on the client's training data at the end of a run
    (SubLoRA's compression bound): ``bound_*`` metrics of the last evaluation, copied into metrics.jsonl."""

    def final_report(self, tokenizer: Any, examples: list[Example], batch_size: int, max_len: int) -> dict[str, Any]:
        """The bound's metrics (``bound_*`` names) for the adapter attached now."""
        ...
