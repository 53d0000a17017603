"""The member's own privacy ledger, kept on its node: every update it sends, counted before it is sent.

The server's ledger (``server_app.ledger``) is the server's word; the member is the party a guarantee protects, so
it keeps its own. Before a train reply leaves the handler, one line is appended (and fsynced) to
``<state-dir>/privacy-ledger/partition-<id>.jsonl``: the logical run (its ``run-dir`` and strategy), the round and
the noise multiplier the instruction carried (``dp-noise-multiplier``; 0 for a round without ``dp.*``: that update
went out with no noise). Nothing removes a line: not a resume, not a fresh run (``resume=false``), not a restarted
SuperNode. Where the node keeps no state directory (simulation without ``state-dir``) the ledger lives in the
client's ``context.state`` for the run.

Under ``dp.*`` the reply says what the member's ledger holds (``record``): its releases, how many carried no
noise, and, when every one carried noise, the epsilon they compose to at the run's delta (every run this node's
ledger has seen, with this data). The member records the noise multiplier it is told; in distributed mode it adds
its own share of that noise, in central mode it trusts the server to add it (docs/privacy.md).

Record-level DP-SGD (``client_app.record_dp``) keeps its steps in the same ledger (``kind: "record"``: the round's
sampling rate, noise multiplier and step count, written after the steps and before the update is sent), so a
member's record-level epsilon composes every DP-SGD step it has ever taken on this data (``record_steps``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context

from common.jsonl import append_durably, whole_lines
from common.logs import get_logger
from common.messages import DpPart
from common.node_config import node_settings
from common.privacy import epsilon_of
from common.record_privacy import Steps

from .state_store import state_root

log = get_logger("tessera.client")

STATE_KEY = "tessera.privacy-ledger"  # context.state's copy, where the node keeps no state directory
_WARNED: set[Path] = set()


def ledger_path(context: Context) -> Path | None:
    """This member's ledger file on its node (None: the node keeps no state directory)."""
    root = state_root(context)
    if root is None:
        return None
    return root / "privacy-ledger" / f"partition-{node_settings(context.node_config).partition_id}.jsonl"


def _entries(context: Context) -> list[dict[str, Any]]:
    path = ledger_path(context)
    if path is not None:
        return whole_lines(path)[0]
    held = context.state.config_records.get(STATE_KEY)
    lines = held["lines"] if held else []
    return [json.loads(line) for line in lines if isinstance(line, str)]  # type: ignore[union-attr]


def _append(context: Context, entry: dict[str, Any]) -> None:
    """Add ``entry`` durably (an ``OSError`` if the node's state directory refuses it)."""
    path = ledger_path(context)
    line = {"run": f"{context.run_config.get('run-dir', '')}|{context.run_config.get('strategy', '')}", **entry}
    if path is None:
        held = context.state.config_records.get(STATE_KEY)
        lines = [str(x) for x in (held["lines"] if held else [])]  # type: ignore[union-attr]
        context.state[STATE_KEY] = ConfigRecord({"lines": [*lines, json.dumps(line)]})
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    append_durably(path, {**line, "time": time.time()})


def _refused(context: Context, err: OSError) -> OSError:
    """The error an uncountable update is refused with: its kind only (the node's path stays in its log)."""
    log.error("privacy ledger not written to %s (node-config state-dir): %s", ledger_path(context), err)
    return OSError(f"the node's privacy ledger could not be written ({type(err).__name__})")


def record(context: Context, server_round: int, dp: DpPart | None) -> dict[str, Any]:
    """Count this round's update before it is sent (``dp``: the instruction's DP part, None without ``dp.*``); the
    reply's ledger metrics under ``dp.*`` (else none). Under ``dp.*`` an ``OSError`` writing the line is raised: an
    update that cannot be counted is not sent."""
    z = dp.noise_multiplier if dp is not None else 0.0
    try:
        _append(context, {"kind": "member", "round": server_round, "noise_multiplier": z})
    except OSError as err:
        if dp is not None:  # under dp.*, an update that cannot be counted is not sent
            raise _refused(context, err) from None
        path = ledger_path(context)
        if path not in _WARNED:  # without dp.* the line only says "no noise": the round goes on
            _WARNED.add(path)  # type: ignore[arg-type]
            log.warning("privacy ledger not written to %s (node-config state-dir): %s", path, err)
        return {}
    if dp is None:
        return {}
    noise = [float(e["noise_multiplier"]) for e in _entries(context) if e.get("kind", "member") == "member"]
    without = sum(1 for n in noise if n <= 0)
    metrics: dict[str, Any] = {"dp_member_releases": len(noise), "dp_member_releases_without_noise": without}
    if not without:
        metrics["dp_member_epsilon"] = epsilon_of(noise, dp.delta)
    log.info(
        "partition %s: privacy ledger: %d release(s), %d without noise%s",
        node_settings(context.node_config).partition_id,
        len(noise),
        without,
        f", epsilon {metrics['dp_member_epsilon']:.3f}" if "dp_member_epsilon" in metrics else "",
    )
    return metrics


def record_steps(context: Context) -> list[Steps]:
    """Every DP-SGD step this member's ledger holds (all runs on this node's data), in order."""
    return [
        Steps(float(e["q"]), float(e["noise_multiplier"]), int(e["steps"]))
        for e in _entries(context)
        if e.get("kind") == "record"
    ]


def count_steps(context: Context, server_round: int, steps: Steps) -> None:
    """Count a round's DP-SGD steps before the update made by them is sent (``OSError``: it must not be sent)."""
    try:
        _append(
            context,
            {"kind": "record", "round": server_round, "q": steps.q, "noise_multiplier": steps.z, "steps": steps.count},
        )
    except OSError as err:
        raise _refused(context, err) from None
