"""A run directory: metrics (JSON lines), the per-round checkpoint, plots and the final adapters.

Layout of ``<run-dir>``:
- ``metrics.jsonl`` — one object per round and node (``node`` null for the aggregate row).
- ``checkpoint/state.json`` + the ``checkpoint/state-<round>.npz`` it names — written atomically after every
  completed round.
- ``eval_loss.png`` — per-client eval loss per round; a strategy's own figures beside it (e.g. SimGrad's
  ``relevance/`` and ``gates.png``).
- ``adapter/`` (or ``adapters/<name>/``) — PEFT adapter directories loadable by ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, cast

import numpy as np

from common.config import resolve_run_dir
from strategies.base import Arrays

from . import plots


class RunDirectory:
    """One run's directory (see the module docstring for its layout). Relative paths resolve against
    ``$TESSERA_RUN_ROOT`` (set by the scripts), else the current directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve_run_dir(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.checkpoint_dir = self.path / "checkpoint"

    # metrics -------------------------------------------------------------------------------------------------
    def append_metrics(self, rows: list[dict[str, Any]]) -> None:
        with open(self.metrics_path, "a") as handle:
            for row in rows:
                handle.write(json.dumps(_jsonable(row)) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        with open(self.metrics_path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def truncate_metrics_after(self, last_round: int) -> None:
        """Drop rows of rounds after ``last_round`` (a crash between metrics and checkpoint leaves such rows)."""
        kept = [r for r in self.read_metrics() if r["round"] <= last_round]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.metrics_path)

    # checkpoint ----------------------------------------------------------------------------------------------
    def save_checkpoint(
        self, server_round: int, strategy_name: str, state: dict[str, Arrays], meta: dict[str, Any]
    ) -> None:
        self.checkpoint_dir.mkdir(exist_ok=True)
        flat = {f"{group}/{key}": value for group, arrays in state.items() for key, value in arrays.items()}
        arrays_name = f"state-{server_round:05d}.npz"
        tmp_npz = self.checkpoint_dir / "state.tmp.npz"
        # cast: mypy checks **flat against savez's allow_pickle: bool too; names are "group/key", never "allow_pickle".
        np.savez(tmp_npz, **cast(dict[str, Any], flat))
        tmp_json = self.checkpoint_dir / "state.tmp.json"
        tmp_json.write_text(
            json.dumps({"round": server_round, "strategy": strategy_name, "arrays": arrays_name, **meta}, indent=2)
        )
        # this round's arrays under their own name, then the json that points at them: a crash at any point leaves
        # a json whose arrays are the ones it names (the previous round's until the json is replaced)
        os.replace(tmp_npz, self.checkpoint_dir / arrays_name)
        os.replace(tmp_json, self.checkpoint_dir / "state.json")
        for old in self.checkpoint_dir.glob("state-*.npz"):
            if old.name != arrays_name:
                old.unlink()

    def has_checkpoint(self) -> bool:
        return (self.checkpoint_dir / "state.json").exists()

    def load_checkpoint(self) -> tuple[dict[str, Any], dict[str, Arrays]] | None:
        meta_path = self.checkpoint_dir / "state.json"
        if not meta_path.exists():
            return None
        meta = json.loads(meta_path.read_text())
        state: dict[str, Arrays] = {}
        with np.load(self.checkpoint_dir / meta.get("arrays", "state.npz")) as data:
            for flat_key in data.files:
                group, key = flat_key.split("/", 1)
                state.setdefault(group, {})[key] = data[flat_key]
        return meta, state

    # plots (server_app/plots.py: what every run has; a strategy draws its own) ----------------------------------
    def plot_eval_loss(self) -> Path:
        return plots.eval_loss(self.read_metrics(), self.path / "eval_loss.png")


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if isinstance(value, (np.floating, np.integer)):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        out[key] = value
    return out
