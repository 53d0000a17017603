"""The do-no-harm guard on a client (``guard.*``; its math is ``common.guard``): what the adapter a message gives
is compared with on the client's validation examples, and what the client keeps.

``guard.reference = "alone"`` (the default): the reference is what training alone would reach. Beside the strategy's
adapter the client trains the local-only baseline's LoRA (``lora.*`` of the run, the baseline's initial adapter, its
batches, its seed and its step size: the same round of training a local-only run of this client does), keeps it in
its state (``guard-alone``) and never sends it. At an evaluate message it measures both on the first
``guard.examples`` validation examples and is evaluated (and, at the last round, saved) with the strategy's only
where that one is lower by ``guard.standard-errors`` of the paired per-example difference
(``common.guard.strategy_kept``), else with the adapter trained alone. What it trains and sends is always the
strategy's, so the federation gets the member's contribution whatever the member keeps. The shared base model
carries one adapter at a time (``client_runtime.LoadedModel.attach``): the client swaps the LoRA in for its training
and its measurement and swaps the strategy's back (module surgery, no reload).

``guard.reference = "own"``: the client's own last trained parameters of the strategy's adapter, mixed with what
the message gives at ``guard.shares`` on train and evaluate messages (``common.guard.choose``). It can refuse what
sharing adds, not reach what another adapter trained alone would (docs/do-no-harm.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from common.adapters import adapter_kind
from common.evaluation import example_losses, token_mean
from common.guard import GUARD_ALONE_KEY, GUARD_STATE_KEY, choose, strategy_kept
from common.logs import get_logger
from common.training import round_learning_rate, train_round

from .runtime import ClientRuntime, node_train_settings, run_config

if TYPE_CHECKING:
    import torch
    from flwr.app import Context

    from common.adapters import AdapterKind
    from common.config import RunConfig

log = get_logger("tessera.client")
ALONE_KIND = "lora"  # the local-only baseline's adapter kind (``local.adapter``'s default)


def alone_reference(cfg: RunConfig) -> bool:
    """Whether this run's clients train the adapter alone beside the strategy's (a local-only run is that already)."""
    return cfg.guarded and cfg.guard.reference == "alone" and cfg.strategy != "local"


def validation_losses(rt: ClientRuntime, model: torch.nn.Module) -> list[tuple[float, int]]:
    """Per validation example the guard reads (the first ``guard.examples`` of the client's validation split), with
    ``model`` as attached now: summed answer-token loss and answer-token count."""
    model.eval()
    cfg = rt.cfg
    examples = rt.validation[: cfg.guard.examples]
    return example_losses(model, rt.tokenizer, examples, cfg.eval.batch_size, cfg.train.max_seq_len)


def validation_loss(rt: ClientRuntime) -> float:
    """The loss per answer token of the model as attached now on the guard's validation examples."""
    return token_mean(validation_losses(rt, rt.model))


def per_example(losses: list[tuple[float, int]]) -> list[float]:
    """Each example's mean loss per answer token (what ``strategy_kept`` pairs)."""
    return [total / max(count, 1) for total, count in losses]


def guard_own(rt: ClientRuntime) -> dict[str, Any]:
    """``guard.reference = "own"``: leave the adapter at the share of what the message set (against the client's
    own last trained adapter) that is lowest in validation loss; returns the guard's metrics (none when it is off,
    or with the other reference)."""
    settings = rt.cfg.guard
    if not rt.cfg.guarded or settings.reference != "own":
        return {}
    own = rt.state.get(GUARD_STATE_KEY)
    if own is None:  # nothing trained yet
        return {"guard_share": 1.0}
    metrics = choose(rt.model, own, settings.shares, lambda: validation_loss(rt))
    losses = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "guard_share")
    log.info(
        "partition %d: guard kept share %.2f of the server's adapter (%s)",
        rt.partition_id,
        metrics["guard_share"],
        losses,
    )
    return metrics


def alone_config(context: Context, rt: ClientRuntime) -> RunConfig:
    """The run's config as this client's model reads it, before a strategy changed anything of it (ATLAS's ranks):
    the settings the local-only baseline trains with."""
    return run_config(context).for_model(rt.model_name)


def attach_alone(rt: ClientRuntime, cfg: RunConfig) -> AdapterKind:
    """The adapter trained alone, attached to the client's base model with the client's kept weights (the
    baseline's initial adapter before its first training). The strategy's adapter is detached: ``rt.reattach``
    brings it back."""
    adapter = rt.loaded.attach(adapter_kind(ALONE_KIND), cfg)
    kept = rt.state.get(GUARD_ALONE_KEY)
    adapter.begin(rt.state, kept if kept is not None else adapter.initial)
    return adapter


def train_alone(context: Context, rt: ClientRuntime, server_round: int, seed: int) -> None:
    """One round of the local-only baseline's training of this client, on the adapter trained alone (kept in its
    state, never sent). ``seed``: the round's (the strategy's batches are the baseline's). Leaves the adapter
    trained alone attached (the next message attaches the strategy's)."""
    cfg = alone_config(context, rt)
    # LoRA steps at train.learning-rate (no step size of its own); the node's memory budget as for the strategy's
    settings = node_train_settings(cfg.train, context.node_config)
    lr = round_learning_rate(settings, server_round, cfg.num_server_rounds)
    began = time.perf_counter()
    adapter = attach_alone(rt, cfg)
    adapter.prepare_training()
    trained = train_round(adapter.model, rt.tokenizer, rt.train, settings, lr, seed=seed)
    arrays, _ = adapter.outgoing()
    rt.state.put(GUARD_ALONE_KEY, arrays)
    log.info(
        "partition %d round %d: the adapter trained alone: loss %.4f (%.1f s with the swap; kept, not sent)",
        rt.partition_id,
        server_round,
        trained["train_loss"],
        time.perf_counter() - began,
    )


def alone_loss(context: Context, rt: ClientRuntime) -> list[tuple[float, int]] | None:
    """The per-example validation losses of the adapter trained alone (None: the guard is off, uses the other
    reference, or the client has not trained yet); the strategy's adapter attached back (its message not begun)."""
    if not alone_reference(rt.cfg) or rt.state.get(GUARD_ALONE_KEY) is None:
        return None
    attach_alone(rt, alone_config(context, rt))
    losses = validation_losses(rt, rt.loaded.model)
    rt.reattach(rt.cfg)
    return losses


def keep_better(context: Context, rt: ClientRuntime, alone: list[tuple[float, int]] | None) -> dict[str, Any]:
    """At an evaluate message, after the strategy set its adapter: the guard's metrics (both adapters' validation
    losses), and, unless the strategy's adapter beats the one trained alone (``alone``, measured before) by
    ``guard.standard-errors`` (``strategy_kept``), that adapter attached as ``rt.adapter`` (the strategy's kept
    state written first, as the end of an evaluation does)."""
    if alone is None:
        return {"guard_share": 1.0} if alone_reference(rt.cfg) else {}
    ours = validation_losses(rt, rt.model)
    strategy, reference = token_mean(ours), token_mean(alone)
    metrics: dict[str, Any] = {"guard_server_loss": strategy, "guard_own_loss": reference}
    if strategy_kept(per_example(ours), per_example(alone), rt.cfg.guard.standard_errors):
        metrics["guard_share"] = 1.0
    else:
        rt.adapter.end(rt.state)
        cfg = alone_config(context, rt)
        rt.adapter, rt.cfg = attach_alone(rt, cfg), cfg
        metrics["guard_share"] = 0.0
    log.info(
        "partition %d: guard: validation loss %.4f with the strategy's adapter, %.4f with the one trained "
        "alone: evaluated with %s",
        rt.partition_id,
        strategy,
        reference,
        "the strategy's" if metrics["guard_share"] else "the one trained alone",
    )
    return metrics
