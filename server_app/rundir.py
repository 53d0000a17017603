"""A run directory: metrics (JSON lines), the per-round checkpoint, plots and the final adapters.

Layout of ``<run-dir>``:
- ``metrics.jsonl`` — one object per round and node (``node`` null for the aggregate row).
- ``checkpoint/state.json`` + the ``checkpoint/state-<round>.npz`` it names — written atomically and fsynced after
  every completed round; the previous round's pair is kept (``state.prev.json``) and used if the last is torn.
- ``eval_loss.png`` — per-client eval loss per round; a strategy's own figures beside it (e.g. SimGrad's
  ``relevance/`` and ``gates.png``).
- ``adapter/`` (or ``adapters/<name>/``) — PEFT adapter directories loadable by ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from pathlib import Path
from typing import Any, cast

import numpy as np

from common.config import resolve_run_dir
from common.logs import get_logger
from strategies.base import Arrays

from . import plots

log = get_logger("tessera.server")


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
        rows = []
        with open(self.metrics_path) as handle:
            lines = handle.read().splitlines()
        for number, line in enumerate(lines, 1):
            try:
                if line.strip():
                    rows.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines):  # only the last line can be torn (a crash while appending)
                    raise ValueError(f"{self.metrics_path}: line {number} is not JSON") from None
                log.warning("%s: its last line is torn (a crash while writing it); ignored", self.metrics_path)
        return rows

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
        """This round's state, durably: its arrays under their own name, then ``state.json`` naming them, each
        written to a temporary file, fsynced and renamed (and the directory fsynced). The previous round's pair
        is kept as ``state.prev.json`` + its arrays: a torn or lost write falls back to it (``load_checkpoint``)."""
        self.checkpoint_dir.mkdir(exist_ok=True)
        flat = {f"{group}/{key}": value for group, arrays in state.items() for key, value in arrays.items()}
        arrays_name = f"state-{server_round:05d}.npz"
        tmp_npz = self.checkpoint_dir / "state.tmp.npz"
        with open(tmp_npz, "wb") as handle:
            # cast: mypy checks **flat against savez's allow_pickle; names are "group/key", never "allow_pickle".
            np.savez(handle, **cast(dict[str, Any], flat))
            _fsync(handle)
        os.replace(tmp_npz, self.checkpoint_dir / arrays_name)
        current = self.checkpoint_dir / "state.json"
        if current.exists():
            os.replace(current, self.checkpoint_dir / "state.prev.json")
        record = {"round": server_round, "strategy": strategy_name, "arrays": arrays_name, **meta}
        _write_durably(current, json.dumps(record, indent=2))
        _fsync_dir(self.checkpoint_dir)
        keep = {arrays_name, _arrays_named(self.checkpoint_dir / "state.prev.json")}
        for old in self.checkpoint_dir.glob("state-*.npz"):
            if old.name not in keep:
                old.unlink()

    def adapter_dir(self, name: str) -> Path:
        """Where a final adapter is saved: ``adapter/`` (one), else ``adapters/<name>/`` with ``name`` (a model
        family, from client-given model names) made one safe path component: it never leaves the run directory."""
        if not name:
            return self.path / "adapter"
        component = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).lstrip(".") or "_"
        return self.path / "adapters" / component

    def has_checkpoint(self) -> bool:
        return any((self.checkpoint_dir / name).exists() for name in ("state.json", "state.prev.json"))

    def load_checkpoint(self) -> tuple[dict[str, Any], dict[str, Arrays]] | None:
        """The last whole checkpoint: ``state.json`` and its arrays, else (torn, truncated, missing) the previous
        round's, with a warning; None if there is none at all."""
        problems = []
        for name in ("state.json", "state.prev.json"):
            path = self.checkpoint_dir / name
            if not path.exists():
                continue
            try:
                meta = json.loads(path.read_text())
                arrays = self.checkpoint_dir / _contained_name(meta.get("arrays"))
                state: dict[str, Arrays] = {}
                with np.load(arrays, allow_pickle=False) as data:
                    for flat_key in data.files:
                        group, key = flat_key.split("/", 1)
                        state.setdefault(group, {})[key] = data[flat_key]
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
                problems.append(f"{path}: {err}")
                continue
            if problems:
                log.warning("checkpoint: %s unreadable; resuming from %s (round %s)", problems, path, meta["round"])
            return meta, state
        if problems:
            raise ValueError(f"resume: no readable checkpoint in {self.checkpoint_dir}: {problems}")
        return None

    # plots (server_app/plots.py: what every run has; a strategy draws its own) ----------------------------------
    def plot_eval_loss(self) -> Path:
        return plots.eval_loss(self.read_metrics(), self.path / "eval_loss.png")


def _contained_name(name: Any) -> str:
    """A file name from ``state.json`` that stays inside the checkpoint directory (no path, no '..')."""
    if not isinstance(name, str) or Path(name).name != name or not name.startswith("state-") or name in ("..", "."):
        raise ValueError(f"arrays {name!r} is not a checkpoint file name")
    return name


def _arrays_named(meta_path: Path) -> str:
    try:
        return _contained_name(json.loads(meta_path.read_text()).get("arrays"))
    except (OSError, ValueError, AttributeError):
        return ""


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        _fsync(handle)
    os.replace(tmp, path)


def _fsync(handle) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if isinstance(value, (np.floating, np.integer)):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        out[key] = value
    return out
