"""Do no harm: a client takes what the server sends only as far as its own validation loss says it helps.

Every strategy starts a client's message from what the server sent (an average, a cluster's adapter, a routed mix)
combined with what the client keeps. Where the federation's adapter is worse for this client than the one it trained
itself, sharing costs it. With ``guard.enabled`` the client compares, on the first ``guard.examples`` examples of
its VALIDATION split (never the test split the verdicts are made on), the adapter the server's message gives it with
mixes towards its own last trained adapter: for each share ``s`` in ``guard.shares`` every trained tensor is
``s * server + (1 - s) * own``; the share with the lowest validation loss is kept (ties go to the larger share, the
server's side). Share 1 is the strategy as it is, share 0 the client's own adapter; ``shares = [0, 1]`` adopts or
refuses, intermediate shares learn how much to mix in.

What is compared: the parameters the client trained in its last round (``snapshot``), kept in the client state
under ``GUARD_STATE_KEY``. Parameters it did not train are left as the message set them. The first message of a run
has no own adapter yet, and neither has a client whose server candidate equals its own (local-only): both skip the
comparison. With ``reference = "alone"`` the choice is ``strategy_kept``: the strategy's adapter must beat the one
trained alone by ``guard.standard-errors`` of the paired per-example difference. Nothing of this leaves the client
but three metrics (the share kept and the two validation losses), so the server learns what it learnt before, plus
how much each client trusts what it sends.

These are plain functions over a torch model and NumPy arrays; ``client_app.handlers`` calls ``guard_start``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

GUARD_STATE_KEY = "guard-own"  # the client state key of its own last trained parameters (declared when enabled)
GUARD_ALONE_KEY = "guard-alone"  # ... and of the LoRA trained alone beside the strategy's (``reference = "alone"``)
GUARD_METRICS = ("guard_share", "guard_server_loss", "guard_own_loss")  # what an evaluate reply carries of it
# ... and a train reply (under its own names: a round's train and eval metrics share one row of metrics.jsonl)
TRAIN_GUARD_METRICS = tuple(f"train_{key}" for key in GUARD_METRICS)


def guard_state_key(reference: str) -> str:
    """The client-state key the guard's reference lives under (``guard.reference``: ``alone`` or ``own``)."""
    return GUARD_ALONE_KEY if reference == "alone" else GUARD_STATE_KEY


def as_train(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The guard's metrics under the names a train reply carries them."""
    return {f"train_{key}": value for key, value in metrics.items()}


def trained_names(model: torch.nn.Module) -> list[str]:
    """The names of the parameters training updates now (``requires_grad``)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def snapshot(model: torch.nn.Module, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Copies of the named parameters as float32 NumPy arrays."""
    params = dict(model.named_parameters())
    return {name: params[name].detach().float().cpu().numpy().copy() for name in names if name in params}


def mixed(server: Mapping[str, np.ndarray], own: Mapping[str, np.ndarray], share: float) -> dict[str, np.ndarray]:
    """``share * server + (1 - share) * own``, tensor by tensor (share 1: the server's; 0: the client's own)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share {share}: expected a value in [0, 1]")
    return {name: share * server[name] + (1.0 - share) * own[name] for name in server}


def best_share(losses: Mapping[float, float]) -> float:
    """The share with the lowest loss; among equal losses the largest share (adopting the server's is the default,
    so the guard refuses only what measurably hurts). A NaN loss never wins."""
    finite = {s: loss for s, loss in losses.items() if np.isfinite(loss)}
    if not finite:
        return max(losses)
    lowest = min(finite.values())
    return max(s for s, loss in finite.items() if loss == lowest)


def strategy_kept(strategy: Sequence[float], alone: Sequence[float], standard_errors: float) -> bool:
    """Whether a client keeps the strategy's adapter against the one trained alone (``guard.reference = "alone"``),
    given each one's loss per validation example (the same examples, in the same order): where the mean of the
    paired differences (strategy's - alone's), plus ``standard_errors`` of their standard errors, is at most 0. So
    the strategy's must win by a margin the examples resolve; with 0 (or one example) a tie keeps the strategy's.
    A NaN loss of the strategy's never wins; one of the adapter trained alone's always loses."""
    ours, theirs = np.asarray(strategy, dtype=np.float64), np.asarray(alone, dtype=np.float64)
    if ours.shape != theirs.shape or ours.ndim != 1 or not len(ours):
        raise ValueError(f"per-example losses of the same examples expected, got {ours.shape} and {theirs.shape}")
    if not np.all(np.isfinite(ours)):
        return False
    if not np.all(np.isfinite(theirs)):
        return True
    difference = ours - theirs
    spread = difference.std(ddof=1) / np.sqrt(len(difference)) if len(difference) > 1 else 0.0
    return bool(difference.mean() + standard_errors * spread <= 0.0)


def comparable(server: Mapping[str, np.ndarray], own: Mapping[str, np.ndarray]) -> list[str]:
    """The names both hold with the same shape (a re-attached adapter of other ranks is not the client's own)."""
    return [name for name in own if name in server and server[name].shape == own[name].shape]


def load(model: torch.nn.Module, values: Mapping[str, np.ndarray]) -> None:
    """Write ``values`` into the model's parameters of those names (in their dtype and device)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            param = params[name]
            param.copy_(torch.from_numpy(np.asarray(value)).to(device=param.device, dtype=param.dtype))


def choose(
    model: torch.nn.Module,
    own: Mapping[str, np.ndarray],
    shares: Sequence[float],
    validation_loss: Callable[[], float],
) -> dict[str, Any]:
    """Leave the model at the share of the server's parameters (against ``own``) with the lowest
    ``validation_loss()``; returns the guard's metrics (``guard_share``, ``guard_server_loss``, ``guard_own_loss``
    where measured). Shares are measured in the order given, the server's (share 1) first if listed, so a tie is
    decided without rounding noise."""
    current = snapshot(model, list(own))
    names = comparable(current, own)
    server = {name: current[name] for name in names}
    own = {name: np.asarray(own[name], dtype=np.float32) for name in names}
    if not names or all(np.array_equal(server[n], own[n]) for n in names):
        return {"guard_share": 1.0}  # nothing to choose between (first message, local-only)
    losses: dict[float, float] = {}
    for share in sorted(set(float(s) for s in shares), reverse=True):
        load(model, mixed(server, own, share))
        losses[share] = float(validation_loss())
    chosen = best_share(losses)
    load(model, mixed(server, own, chosen))
    metrics: dict[str, Any] = {"guard_share": chosen}
    if 1.0 in losses:
        metrics["guard_server_loss"] = losses[1.0]
    if 0.0 in losses:
        metrics["guard_own_loss"] = losses[0.0]
    return metrics
