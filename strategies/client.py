"""The client half of a strategy: what it adds to a client's replies and what it keeps between messages.

The ClientApp (``client_app.handlers``) trains and evaluates the run's adapter kind the same way for every
strategy; a strategy's client half only adds to that: a per-round report (SimGrad's signature, ATLAS's
fingerprint), a post-processing of what is sent (SimGrad's alignment), a member weight, and state under the keys
it declares. This base is the client half of a strategy that adds nothing (FedAvg).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .base import WEIGHT_BY_EXAMPLES, WEIGHT_EQUALLY, Arrays

if TYPE_CHECKING:
    from common.adapters import AdapterKind, ClientState
    from common.config import RunConfig
    from common.data import Example
    from common.messages import Part


class ProbeModel(Protocol):
    """A frozen base model loaded for probing (SimGrad's signatures); its attached adapter, if any, is some
    client's and must be bypassed with ``adapter.disabled()``."""

    @property
    def model(self) -> Any: ...  # the model with whatever adapter is attached (call it inside adapter.disabled())
    @property
    def tokenizer(self) -> Any: ...
    @property
    def adapter(self) -> AdapterKind | None: ...


class ClientRuntime(Protocol):
    """What a client half may read and call, and nothing else: the contract between a strategy and the ClientApp
    (which implements it: ``client_app.runtime.ClientRuntime``).

    Attributes:
        cfg: this message's run config (ATLAS may swap in a client's own LoRA ranks: ``reattach``).
        adapter: the run's adapter kind attached to the client's base model (``initial``: the run's starting
            arrays; ``save``, ``outgoing``, ``received``, ``state_keys``; the kind's own API, e.g. PQ-LoRA's).
        state: the client's kept arrays, under the keys its strategy and adapter kind declare.
        partition_id: the client's data partition; node_config: its SuperNode's node config.
        train: the client's training examples (the held-out split is not the strategy's to read).
        tokenizer, model_name: of the client's base model.
    """

    cfg: RunConfig
    adapter: AdapterKind
    state: ClientState
    partition_id: int
    node_config: dict[str, Any]

    @property
    def train(self) -> list[Example]: ...
    @property
    def tasks(self) -> str: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def model_name(self) -> str: ...
    def reattach(self, cfg: RunConfig) -> None:
        """Attach the run's adapter kind with ``cfg``'s settings (e.g. a client's own ranks) for this message."""
        ...

    def probe(self, name: str) -> ProbeModel:
        """The frozen base model ``name``, loaded once per process like any other."""
        ...


class StrategyClient:
    """The base client half (FedAvg's): nothing to report, the update sent as trained, weighted as asked.

    Attributes:
        state_keys: the ``ClientState`` keys this strategy keeps on a client (with the adapter kind's, the only
            keys a deployed node's model worker carries between messages).
    """

    state_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def configure(self, rt: ClientRuntime, wire: Part | None) -> None:
        """Adapt the client to a train or evaluate instruction before its arrays are read (``wire``: the strategy's
        part of it, its ``StrategySpec.wire`` schema read, or None; ATLAS: attach the client's own LoRA ranks);
        default: nothing."""

    def wire_reference(self, rt: ClientRuntime, wire: Part | None) -> Arrays:
        """The names and shapes of the arrays the server sends with this instruction (and a train reply carries);
        default: the adapter's own."""
        return rt.adapter.initial

    def start(self, rt: ClientRuntime, received: Arrays | None) -> Arrays | None:
        """What the adapter starts this message from, given what the server sent (None: nothing); default: that."""
        return received

    def ready(self, rt: ClientRuntime, wire: Part | None, training: bool) -> None:
        """The adapter now holds what this message starts from: set up what depends on it before training
        (``training``) or evaluation (VEMoE probes its experts and routes); default: nothing."""

    def report(self, rt: ClientRuntime, state: ClientState, server_round: int) -> tuple[Arrays, dict[str, Any]]:
        """This round's report (arrays and metrics) for a server half with ``wants_reports``."""
        raise ValueError(f"strategy '{self.cfg.strategy}' sends no reports")

    def outgoing(self, rt: ClientRuntime, arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """What is sent after training (default: the adapter's update as it is) and metrics to add to the reply."""
        return arrays, {}

    def member_weight(self, weight_by: str, train_metrics: dict[str, Any]) -> int:
        """This member's whole-number weight in its group's sum, as the group asked (``Group.weight_by``): a strategy
        with a weighting of its own overrides it (the toy strategy of the tests weighs by partition)."""
        if weight_by == WEIGHT_BY_EXAMPLES:
            return int(train_metrics["train_examples"])
        if weight_by == WEIGHT_EQUALLY:
            return 1
        raise ValueError(f"weight-by: '{weight_by}' is not a weighting strategy '{self.cfg.strategy}' knows")

    def save(self, rt: ClientRuntime, out_dir: Path) -> Path | None:
        """The client's own copy of its final adapter, where the server's lacks parts (default: the kind decides)."""
        return rt.adapter.save(out_dir, rt.model_name)


def save_whole_adapter(rt: ClientRuntime, out_dir: Path) -> Path | None:
    """Save the adapter attached now as a whole (PEFT for LoRA): for strategies whose adapters live only on the
    clients (local-only, MIRA), so the client's copy is the only one."""
    from common.adapters.personal import DualPath

    own = rt.adapter.save(out_dir, rt.model_name)
    # A dual-path kind saves its personal LoRA (and the kind's own copy where the kind keeps one); a LoRA's
    # travelling half, the client's only copy here, is written as the server would write it.
    if own is not None and (rt.adapter.keeps_adapter or not isinstance(rt.adapter, DualPath)):
        return own
    arrays, _ = rt.adapter.outgoing()
    return type(rt.adapter).save_server_copy(arrays, rt.cfg, rt.model_name, out_dir)
