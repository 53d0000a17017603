"""What a strategy is to the system: its name, two halves, adapter kind and config sections (``StrategySpec``).

Each strategy package builds its ``SPEC`` from this module alone, so that a strategy imports no registry (which
imports every strategy) and no other strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import Strategy
from .client import StrategyClient

if TYPE_CHECKING:
    from common.config import RunConfig, Section
    from common.messages import Part


@dataclass(frozen=True)
class StrategySpec:
    """Everything the system needs to run one strategy.

    Attributes:
        name: the run-config value (``strategy = "..."``).
        server: the server half (``Strategy`` subclass, built with ``from_config``).
        client: the client half (``StrategyClient`` subclass).
        adapter: the adapter kind its clients train (a key of ``common.adapters.ADAPTER_KINDS``).
        section: its run-config section (``section.key`` is the prefix of its keys), or None.
        adapter_from: for a strategy that trains any kind (the local-only baseline), the kind a run config picks;
            None: always ``adapter``.
        shared_sections: sections it shares with other strategies (ATLAS's and MIRA's ``fingerprint.*``).
        wire: its part of the train and evaluate instructions (a ``common.messages.Part`` whose fields' aliases are
            its keys, e.g. ATLAS's ranks), or None: it sends none. The client reads it into that part and refuses a
            key no schema of the run has; registration refuses a key a core part has.
        dp_refusal: why a differentially private run (``dp.mode``) of it cannot be accounted: what it releases
            beside its group sums (None: nothing, so the sums' noise covers it). A new strategy is refused until it
            says.
        record_dp_refusal: why record-level DP-SGD (``dp.record-*``, or a member's own ``dp-record-epsilon``) does not
            cover what it sends: what it computes from a member's records outside the DP-SGD steps (None: nothing,
            its update is post-processing of them). A new strategy is refused until it says.
        guarded_by_default: whether ``guard.enabled = "auto"`` (the default) runs the do-no-harm guard for it: for
            a strategy whose shared adapter can leave a member worse than training alone and that has no personal
            path of its own measured to prevent it (docs/do-no-harm.md).
    """

    name: str
    server: type[Strategy]
    client: type[StrategyClient]
    adapter: str
    section: type[Section] | None = None
    adapter_from: Callable[[RunConfig], str] | None = None
    shared_sections: tuple[type[Section], ...] = ()
    wire: type[Part] | None = None
    dp_refusal: str | None = "it has not declared what it releases beside its group sums"
    record_dp_refusal: str | None = "it has not declared what it computes from the records outside DP-SGD"
    guarded_by_default: bool = False

    def adapter_for(self, cfg: RunConfig) -> str:
        """The adapter kind a run of this strategy trains."""
        return self.adapter if self.adapter_from is None else self.adapter_from(cfg)

    def sections(self, cfg: RunConfig) -> list[type[Section]]:
        """The config sections a run of this strategy reads beyond the core: its adapter kind's and its own."""
        from common.adapters import adapter_kind

        kind = adapter_kind(self.adapter_for(cfg))
        own = [self.section] if self.section is not None else []
        return [kind.section, *kind.extra_sections, *own, *self.shared_sections]

    def state_keys(self, cfg: RunConfig) -> tuple[str, ...]:
        """Every client-state key a client of this strategy keeps (adapter kind's + client half's, and the guard's
        reference where the run is guarded, ``RunConfig.guarded``: the adapter trained alone, or the client's own
        copy)."""
        from common.adapters import adapter_kind
        from common.guard import guard_state_key

        guard = (guard_state_key(cfg.guard.reference),) if cfg.guarded else ()
        return (*adapter_kind(self.adapter_for(cfg)).state_keys, *self.client.state_keys, *guard)
