"""Evaluation that stays on the member's node: its held-out losses, exact match, ROUGE-L, per-example values and the
counts of its splits are computed from its test records, which no DP-SGD step touches, so a member that wants
nothing unaccounted to leave keeps them.

The member decides (node-config ``keep-evaluation=true``, beside its ``data-path``); the run may ask every member
to (``eval.keep-on-node=true``); the server cannot make a member send them. A member that keeps them writes each
evaluation to ``<run-dir>/client-evaluation/partition-<id>.jsonl`` on its node (and its log) and replies only that
it evaluated (``eval_kept_on_node``); its train and report replies carry no split counts either.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.config import RunConfig
from common.jsonl import append_durably
from common.node_config import node_settings
from common.reply_checks import KEPT_ON_NODE


def keeps_evaluation(node_config: Mapping[str, Any], cfg: RunConfig) -> bool:
    """Whether this member keeps its evaluation on its node: its own node config says so (``keep-evaluation``), or
    the run asks it to. ValueError naming the key (not the value) for a value that is not true or false."""
    return node_settings(node_config).keep_evaluation or cfg.eval.keep_on_node


def kept_reply(metrics: dict[str, Any], directory: Path, partition_id: int, server_round: int) -> dict[str, Any]:
    """Append ``metrics`` (this round's evaluation, computed here) to the member's own file under ``directory``;
    what goes to the server instead: that it evaluated, and nothing measured."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    append_durably(directory / f"partition-{partition_id}.jsonl", {"round": server_round, **metrics})
    return {KEPT_ON_NODE: 1}
