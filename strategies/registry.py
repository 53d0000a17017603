"""The one list of strategies: a name -> its server half, client half, adapter kind and config section.

The run config is assembled here (``load_run_config``: the core keys of ``common.config`` with every adapter kind's
and strategy's section, checked for the run's strategy), so the layer below knows no strategy. The ServerApp, the
ClientApp and the run directory reach a strategy only through ``strategy_spec``. Adding a strategy is one package
under ``strategies/`` and one ``register`` call here (see "Adding a strategy" in the docs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .spec import StrategySpec

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from common.config import Plan, RunConfig, Section


REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    """Add a strategy; its name, config section key and state keys must not clash with another's, nor its wire
    keys with a core message part's (``common.messages``)."""
    from common.adapters import ADAPTER_KINDS
    from common.config import RunConfig
    from common.messages import clashes

    if spec.name in REGISTRY and REGISTRY[spec.name] != spec:
        raise ValueError(f"strategy '{spec.name}' is already registered")
    if spec.adapter not in ADAPTER_KINDS:
        raise ValueError(
            f"strategy '{spec.name}': unknown adapter kind '{spec.adapter}' (have {sorted(ADAPTER_KINDS)})"
        )
    problem = _halves_problem(spec)
    if problem:
        raise ValueError(f"strategy '{spec.name}': {problem}")
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
    if spec.wire is not None and (taken_keys := clashes(spec.wire)):
        raise ValueError(f"strategy '{spec.name}': its wire keys {taken_keys} are a core message part's")
    for shared in spec.shared_sections:
        owners = [s.name for s in REGISTRY.values() if s.section is not None and s.section.key == shared.key]
        if shared.key.replace("-", "_") in RunConfig.model_fields or shared.key in ADAPTER_KINDS or owners:
            raise ValueError(f"strategy '{spec.name}': shared config section key '{shared.key}' is taken")
    REGISTRY[spec.name] = spec
    return spec


def _halves_problem(spec: StrategySpec) -> str | None:
    """Why a spec's two halves or its wire schema cannot run (None: they can), found at registration rather than at
    a client's first message: a server half that is not a ``Strategy`` or leaves a required method abstract, a
    client half that is not a ``StrategyClient``, a wire schema that is not a ``common.messages.Part``."""
    import inspect

    from common.messages import Part

    from .base import Strategy
    from .client import StrategyClient

    if not (inspect.isclass(spec.server) and issubclass(spec.server, Strategy)):
        return "its server half is not a strategies.base.Strategy"
    if inspect.isabstract(spec.server):
        return f"its server half does not implement {sorted(spec.server.__abstractmethods__)}"
    if not (inspect.isclass(spec.client) and issubclass(spec.client, StrategyClient)):
        return "its client half is not a strategies.client.StrategyClient"
    if spec.wire is not None and not (inspect.isclass(spec.wire) and issubclass(spec.wire, Part)):
        return "its wire schema is not a common.messages.Part"
    return None


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


def run_plan(cfg: RunConfig) -> Plan:
    """What the run's strategy says of a validated config: its adapter kind (and that kind's section) and the
    sections it reads (whose ``check`` must pass). ValueError naming the ``strategy`` key for a name nobody
    registered."""
    from common.adapters import adapter_kind
    from common.config import Plan

    spec = strategy_spec(cfg.strategy)
    if cfg.dp.enabled and spec.dp_refusal:
        raise ValueError(f"dp.mode: strategy '{spec.name}' cannot be run with differential privacy: {spec.dp_refusal}")
    if cfg.dp.record_enabled and spec.record_dp_refusal:
        raise ValueError(
            f"dp.record-epsilon: strategy '{spec.name}' cannot be run with record-level DP: {spec.record_dp_refusal}"
        )
    adapter = spec.adapter_for(cfg)
    return Plan(adapter, adapter_kind(adapter).section, spec.sections(cfg), spec.guarded_by_default)


def load_run_config(flat: Mapping[str, Any]) -> RunConfig:
    """The run config of Flower's flattened run config (``{"train.local-steps": 8, ...}``): the core keys and every
    registered section validated, then the checks of the run's strategy and adapter (``ConfigError`` naming every
    bad key)."""
    from common.config import RunConfig

    return RunConfig.from_flat(flat, config_sections(), run_plan)


def _register_builtin() -> None:
    from .atlas import SPEC as ATLAS
    from .fedavg import SPEC as FEDAVG
    from .fedavg import SPEC_DUAL as FEDAVG_DUAL
    from .fedsa_lora import SPEC as FEDSA_LORA
    from .local import SPEC as LOCAL
    from .mira import SPEC as MIRA
    from .simgrad import SPEC as SIMGRAD
    from .vemoe import SPEC as VEMOE

    for spec in (FEDAVG, FEDAVG_DUAL, FEDSA_LORA, SIMGRAD, LOCAL, MIRA, ATLAS, VEMOE):
        register(spec)


_register_builtin()
