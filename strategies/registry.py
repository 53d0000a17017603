"""The one list of strategies: a name -> its server half, client half, adapter kind and config section.

Config validation (``common.config``), the ServerApp, the ClientApp and the run directory reach a strategy only
through ``strategy_spec``. Adding a strategy is one package under ``strategies/`` and one ``register`` call here
(see the README's "Adding a strategy").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import Strategy
from .client import StrategyClient

if TYPE_CHECKING:
    from common.config import RunConfig, Section


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
    """

    name: str
    server: type[Strategy]
    client: type[StrategyClient]
    adapter: str
    section: type[Section] | None = None
    adapter_from: Callable[[RunConfig], str] | None = None
    shared_sections: tuple[type[Section], ...] = ()

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
        """Every client-state key a client of this strategy keeps (adapter kind's + client half's)."""
        from common.adapters import adapter_kind

        return (*adapter_kind(self.adapter_for(cfg)).state_keys, *self.client.state_keys)


REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    """Add a strategy; its name, config section key and state keys must not clash with another's."""
    from common.adapters import ADAPTER_KINDS
    from common.config import RunConfig

    if spec.name in REGISTRY and REGISTRY[spec.name] != spec:
        raise ValueError(f"strategy '{spec.name}' is already registered")
    if spec.adapter not in ADAPTER_KINDS:
        raise ValueError(
            f"strategy '{spec.name}': unknown adapter kind '{spec.adapter}' (have {sorted(ADAPTER_KINDS)})"
        )
    if spec.server.name != spec.name:
        raise ValueError(f"strategy '{spec.name}': its server class says name = '{spec.server.name}'")
    if spec.section is not None:
        key = spec.section.key
        taken = (
            set(RunConfig.model_fields)
            | set(ADAPTER_KINDS)
            | {extra.key for kind in ADAPTER_KINDS.values() for extra in kind.extra_sections}
            | {s.section.key for s in REGISTRY.values() if s.section is not None and s.name != spec.name}
        )
        if not key or key.replace("-", "_") in taken or key in taken:
            raise ValueError(f"strategy '{spec.name}': config section key '{key}' is empty or taken")
    for shared in spec.shared_sections:
        owners = [s.name for s in REGISTRY.values() if s.section is not None and s.section.key == shared.key]
        if shared.key.replace("-", "_") in RunConfig.model_fields or shared.key in ADAPTER_KINDS or owners:
            raise ValueError(f"strategy '{spec.name}': shared config section key '{shared.key}' is taken")
    REGISTRY[spec.name] = spec
    return spec


def strategy_spec(name: str) -> StrategySpec:
    """The registered strategy called ``name`` (ValueError naming the ``strategy`` key otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"strategy: '{name}' is not a registered strategy (registered: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]


def config_sections() -> dict[str, type[Section]]:
    """Every adapter kind's and registered strategy's config section, by key."""
    from common.adapters import ADAPTER_KINDS

    sections = {s.key: s for kind in ADAPTER_KINDS.values() for s in (kind.section, *kind.extra_sections)}
    sections.update({s.section.key: s.section for s in REGISTRY.values() if s.section is not None})
    sections.update({shared.key: shared for s in REGISTRY.values() for shared in s.shared_sections})
    return sections


def _register_builtin() -> None:
    from .atlas import SPEC as ATLAS
    from .fedavg import SPEC as FEDAVG
    from .fedavg import SPEC_DUAL as FEDAVG_DUAL
    from .fedsa_lora import SPEC as FEDSA_LORA
    from .local import SPEC as LOCAL
    from .mira import SPEC as MIRA
    from .simgrad import SPEC as SIMGRAD

    for spec in (FEDAVG, FEDAVG_DUAL, FEDSA_LORA, SIMGRAD, LOCAL, MIRA, ATLAS):
        register(spec)


_register_builtin()
