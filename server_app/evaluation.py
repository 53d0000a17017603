"""A round's evaluation: each node evaluates the adapter the strategy gives it; its row carries what it trained this
round beside what that did, and the round's aggregate row (weighted by held-out examples) closes the round."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import psutil

from common.data import DATA_COUNT_KEYS
from common.guard import GUARD_METRICS
from common.logs import get_logger
from common.messages import Identity
from common.records import num_bytes
from common.reply_checks import KEPT_ON_NODE

from .transport import evaluate_nodes

if TYPE_CHECKING:
    from common.config import RunConfig
    from strategies import Strategy

    from .rundir import RunDirectory

log = get_logger("tessera.server")

EVAL_ROW_KEYS = ("eval_loss", "perplexity", "exact_match", "rouge_l", "eval_examples", "eval_seconds")
# ... and these when sent (the per-example losses and token counts are what a comparison bootstraps over)
EVAL_ROW_EXTRAS = ("eval_generated", "eval_loss_seconds", "eval_example_loss", "eval_example_tokens", *GUARD_METRICS)


def evaluate_round(
    grid,
    cfg: RunConfig,
    strategy: Strategy,
    run: RunDirectory,
    server_round: int,
    node_ids: list[int],
    train_rows,
    started: float,
    partitions: dict[int, int] | None = None,
) -> None:
    """Evaluate ``node_ids`` with the strategy's adapters; append their rows (with ``train_rows``' training fields)
    and the round's aggregate row to the metrics file, and log the round."""
    arrays_by_node = {nid: strategy.eval_arrays(nid) for nid in node_ids}
    configs = {nid: strategy.eval_config(nid) for nid in node_ids}
    asked = cfg.eval.examples_at(server_round, cfg.num_server_rounds)
    evaluated = evaluate_nodes(
        grid,
        server_round,
        arrays_by_node,
        cfg.round_timeout,
        configs,
        asked,
        partitions,
    )
    rows, totals = [], {"eval_loss": 0.0, "exact_match": 0.0, "rouge_l": 0.0, "n": 0, "generated": 0}
    seconds = time.perf_counter() - started
    for nid in node_ids:
        metrics = evaluated.get(nid)
        row: dict[str, Any] = {"round": server_round, "node": nid, "seconds": seconds}
        row.update(train_rows.get(nid, {"bytes_up": 0, "bytes_down": 0}))
        row["bytes_up"] = row.get("bytes_up", 0) + row.get("report_bytes", 0)
        row["bytes_down"] = row.get("bytes_down", 0) + num_bytes(arrays_by_node[nid])
        if isinstance(metrics, dict) and KEPT_ON_NODE in metrics:  # the member kept what it measured
            row.update({k: None for k in EVAL_ROW_KEYS} | {KEPT_ON_NODE: True})
            row.update({k.replace("-", "_"): metrics.get(k) for k in Identity.keys()})
        elif isinstance(metrics, dict):
            row.update({k: metrics.get(k) for k in EVAL_ROW_KEYS})
            row.update({k: metrics[k] for k in EVAL_ROW_EXTRAS if k in metrics})
            row.update({k: v for k, v in metrics.items() if k.startswith("bound_")})  # an adapter's bound (SubLoRA)
            row.update({k.replace("-", "_"): metrics.get(k) for k in (*Identity.keys(), *DATA_COUNT_KEYS)})
            # typed and bounded where the reply was checked (common.reply_checks.check_eval_metrics)
            n = metrics["eval_examples"]
            generated = metrics.get("eval_generated", n)  # EM and ROUGE-L come from the generated subset
            totals["eval_loss"] += metrics["eval_loss"] * n
            for key in ("exact_match", "rouge_l"):
                totals[key] += metrics[key] * generated
            totals["n"] += n
            totals["generated"] += generated
        else:
            row.update({"eval_loss": None, "exact_match": None, "rouge_l": None, "eval_error": metrics})
        rows.append(row)
    total = max(totals["n"], 1)
    aggregate = {"round": server_round, "node": None, "seconds": seconds, **train_rows.get(None, {})}
    aggregate["server_rss_mb"] = psutil.Process().memory_info().rss / 2**20  # the ServerApp's process now
    aggregate["eval_loss"] = totals["eval_loss"] / total if totals["n"] else None
    aggregate.update(
        {k: (totals[k] / totals["generated"] if totals["generated"] else None) for k in ("exact_match", "rouge_l")}
    )
    aggregate["bytes_up"] = sum(r.get("bytes_up", 0) for r in rows)
    aggregate["bytes_down"] = sum(r.get("bytes_down", 0) for r in rows)
    aggregate["routing_bytes_saved"] = sum(r.get("routing_bytes_saved", 0) for r in rows)
    rows.append(aggregate)
    run.append_metrics(rows)
    log.info(
        "round %d: eval loss %s | EM %s | ROUGE-L %s | %.1fs",
        server_round,
        _fmt(aggregate["eval_loss"]),
        _fmt(aggregate["exact_match"]),
        _fmt(aggregate["rouge_l"]),
        seconds,
    )


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def kept_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The run's last word on members that kept their evaluation on their nodes (none: nothing)."""
    kept = sorted({r["partition_id"] for r in rows if r.get(KEPT_ON_NODE) and r.get("partition_id") is not None})
    if not kept:
        return []
    which = ", ".join(str(p) for p in kept)
    return [f"partition(s) {which} kept their evaluation on their nodes (in client-evaluation/ of the run directory)"]
