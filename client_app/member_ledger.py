"""The member's own privacy ledger, kept on its node: every update it sends, counted before it is sent.

The server's ledger (``server_app.ledger``) is the server's word; the member is the party a guarantee protects, so
it keeps its own. Before a train reply leaves the handler, one line is appended (and fsynced) to
``<state-dir>/privacy-ledger/partition-<id>.jsonl``: the logical run (its ``run-dir`` and strategy), the round and
the noise multiplier the instruction carried (``dp-noise-multiplier``; 0 for a round without ``dp.*``: that update
went out with no noise). Nothing removes a line: not a resume, not a fresh run (``resume=false``), not a restarted
SuperNode. Where the node keeps no state directory (simulation without ``state-dir``) the ledger lives in the
client's ``context.state`` for the run.

Under ``dp.*`` the reply says what the member's ledger holds (``ledger_metrics``): its releases, how many carried no
noise, and, when every one carried noise, the epsilon they compose to at the run's delta (every run this node's
ledger has seen, with this data). The member records the noise multiplier it is told; in distributed mode it adds
its own share of that noise, in central mode it trusts the server to add it (docs/privacy.md).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context

from common.jsonl import append_durably, whole_lines
from common.logs import get_logger
from common.privacy import DP_DELTA, DP_NOISE_MULTIPLIER, epsilon_of

from .state_store import state_root

log = get_logger("tessera.client")

STATE_KEY = "tessera.privacy-ledger"  # context.state's copy, where the node keeps no state directory
_WARNED: set[Path] = set()


def ledger_path(context: Context) -> Path | None:
    """This member's ledger file on its node (None: the node keeps no state directory)."""
    root = state_root(context)
    if root is None:
        return None
    return root / "privacy-ledger" / f"partition-{int(context.node_config.get('partition-id', 0))}.jsonl"


def record(context: Context, server_round: int, config: dict[str, Any]) -> dict[str, Any]:
    """Count this round's update before it is sent; the reply's ledger metrics under ``dp.*`` (else none). Under
    ``dp.*`` an ``OSError`` writing the line is raised: an update that cannot be counted is not sent."""
    z = float(config.get(DP_NOISE_MULTIPLIER, 0.0))
    run = f"{context.run_config.get('run-dir', '')}|{context.run_config.get('strategy', '')}"
    line = {"run": run, "round": server_round, "noise_multiplier": z, "time": time.time()}
    path = ledger_path(context)
    if path is None:
        held = context.state.config_records.get(STATE_KEY)
        earlier = held["noise"] if held else []
        noise: list[float] = [*(float(n) for n in earlier if isinstance(n, (int, float))), z]  # type: ignore[union-attr]
        context.state[STATE_KEY] = ConfigRecord({"noise": noise})
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            append_durably(path, line)
        except OSError as err:
            if DP_DELTA in config:  # under dp.*, an update that cannot be counted is not sent (its path stays here)
                log.error("privacy ledger not written to %s (node-config state-dir): %s", path, err)
                raise OSError(f"the node's privacy ledger could not be written ({type(err).__name__})") from None
            if path not in _WARNED:  # without dp.* the line only says "no noise": the round goes on
                _WARNED.add(path)
                log.warning("privacy ledger not written to %s (node-config state-dir): %s", path, err)
            return {}
        noise = [float(e.get("noise_multiplier", 0.0)) for e in whole_lines(path)[0]]
    if DP_DELTA not in config:
        return {}
    without = sum(1 for n in noise if n <= 0)
    metrics: dict[str, Any] = {"dp_member_releases": len(noise), "dp_member_releases_without_noise": without}
    if not without:
        metrics["dp_member_epsilon"] = epsilon_of(noise, float(config[DP_DELTA]))
    log.info(
        "partition %s: privacy ledger: %d release(s), %d without noise%s",
        context.node_config.get("partition-id", 0),
        len(noise),
        without,
        f", epsilon {metrics['dp_member_epsilon']:.3f}" if "dp_member_epsilon" in metrics else "",
    )
    return metrics
