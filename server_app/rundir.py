"""A run directory: metrics (JSON lines), the per-round checkpoint, plots and the final adapters.

Layout of ``<run-dir>``:
- ``metrics.jsonl`` — one object per round and node (``node`` null for the aggregate row).
- ``checkpoint/state.json`` + the ``checkpoint/state-<round>.npz`` it names — written atomically and fsynced after
  every completed round; the previous round's pair is kept (``state.prev.json``) and used if the last is torn. A
  checkpoint that cannot be written (disk full, ...) leaves the previous one as it was and no partial file behind
  (``CheckpointError``).
- ``tensorboard/`` — the same rows as live curves, written every round (``server_app.live``; ``live-curves``).
- ``eval_loss.png`` — per-client eval loss per round; a strategy's own figures beside it (e.g. SimGrad's
  ``relevance/`` and ``gates.png``).
- ``adapter/`` (or ``adapters/<name>/``, one per name: ``adapter_dir``) — PEFT adapter directories loadable by
  ``PeftModel.from_pretrained``.

``RunDirectory.check_writable`` proves that all this can be written before the first round (a read-only run dir or
a full disk is found before any node is asked for anything, not after round 0's evaluation:
``RunDirNotWritableError``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, cast

import numpy as np

from common import plots
from common.config import resolve_run_dir
from common.logs import get_logger
from strategies.base import Arrays

from .live import LiveCurves

log = get_logger("tessera.server")

_MAX_KEPT_NAME = 200  # an adapter directory's name at most (file systems allow 255 bytes)
_PROBE_BYTES = 4096  # what check_writable writes, fsyncs and removes: one block
_FULL = (errno.ENOSPC, errno.EDQUOT)


class RunDirNotWritableError(OSError):
    """The run dir (or its checkpoint directory, or its ``metrics.jsonl``) cannot be written: read-only, not this
    user's, or its disk full. ``errno`` is the system's (EACCES, EROFS, ENOSPC, ...)."""


class CheckpointError(OSError):
    """A round's checkpoint could not be written; the previous checkpoint is kept as it was. ``errno`` is the
    system's (ENOSPC, ...)."""


class MetricsError(OSError):
    """Rows could not be written to ``metrics.jsonl``; the file is left as it was before the write (no torn line).
    ``errno`` is the system's (ENOSPC, ...)."""


def _os_error(kind: type[OSError], message: str, cause: OSError) -> OSError:
    """``kind(message)`` carrying ``cause``'s errno (its ``str`` is the message alone)."""
    err = kind(message)
    err.errno = cause.errno
    return err


class RunDirectory:
    """One run's directory (see the module docstring for its layout), created if missing (else
    ``RunDirNotWritableError``). Relative paths resolve against ``$TESSERA_RUN_ROOT`` (set by the scripts), else
    the current directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve_run_dir(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _not_writable(self.path, err) from err
        self.metrics_path = self.path / "metrics.jsonl"
        self.checkpoint_dir = self.path / "checkpoint"
        self.live = LiveCurves(self.path / "tensorboard", enabled=False)  # until ``watch``

    def watch(self, enabled: bool, fresh: bool) -> None:
        """Send every round's rows to TensorBoard from now on (``server_app.live``). The curves are made anew:
        ``fresh`` (a run starting over) with nothing, else (a resume) from the metrics kept, so that a round redone
        after a kill is on them once."""
        directory = self.path / "tensorboard"
        self.live.close()
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)
        self.live = LiveCurves(directory, enabled)
        if not fresh:
            kept = self.read_metrics()
            self.live.add(kept)
            self.live.add_kept_images(self.path, max((int(row["round"]) for row in kept), default=-1))

    def check_writable(self) -> None:
        """Prove that the run can write its results now, before any node is asked for anything: a small file is
        created, written, fsynced and removed in the run dir and in its checkpoint directory (created if missing),
        and an existing ``metrics.jsonl`` is opened for appending. Raises ``RunDirNotWritableError`` naming the
        directory (or file) and what to do."""
        for directory in (self.path, self.checkpoint_dir):
            try:
                directory.mkdir(exist_ok=True)
                _probe(directory)
            except OSError as err:
                raise _not_writable(directory, err) from err
        if self.metrics_path.exists():  # a resume appends to it
            try:
                os.close(os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND))
            except OSError as err:
                raise _not_writable(self.metrics_path, err) from err

    # metrics -------------------------------------------------------------------------------------------------
    def append_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Append ``rows`` as whole lines; if the disk refuses (full, ...), the file is cut back to where it was and
        ``MetricsError`` names it: the round's rows are written whole or not at all, and the round is not
        checkpointed, so ``resume=true`` redoes it once there is space."""
        text = "".join(json.dumps(_jsonable(row)) + "\n" for row in rows)
        size = self.metrics_path.stat().st_size if self.metrics_path.exists() else 0
        try:
            with open(self.metrics_path, "a") as handle:
                handle.write(text)
                handle.flush()
        except OSError as err:
            try:
                with open(self.metrics_path, "r+b") as handle:
                    handle.truncate(size)
            except OSError as cut:
                log.error("metrics: could not cut %s back to %d bytes: %s", self.metrics_path, size, cut)
            raise _os_error(MetricsError, _metrics_message(self.metrics_path, "rows not written", err), err) from err
        self.live.add(rows)

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
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.metrics_path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            message = _metrics_message(
                self.metrics_path, f"rows after round {last_round} not dropped (kept as they were)", err
            )
            raise _os_error(MetricsError, message, err) from err

    # checkpoint ----------------------------------------------------------------------------------------------
    def save_checkpoint(
        self, server_round: int, strategy_name: str, state: dict[str, Arrays], meta: dict[str, Any]
    ) -> None:
        """This round's state, durably: its arrays under their own name, then ``state.json`` naming them, each
        written to a temporary file, fsynced and renamed (and the directory fsynced). The previous round's pair
        is kept as ``state.prev.json`` + its arrays: a torn or lost write falls back to it (``load_checkpoint``).

        The order makes every point of failure safe: the new arrays and json are written in full (temporary
        files) before anything is renamed; then the current ``state.json`` is copied to ``state.prev.json``
        (itself through a temporary file, and only if it is whole: a torn one never replaces a good previous
        round); only then is the new json renamed over ``state.json``. So ``state.json`` always names a whole
        checkpoint, the previous round's or this one's. On an ``OSError`` (disk full, ...) before that last rename,
        ``state.prev.json`` is put back as it was; then the temporary files and the arrays no json names are removed
        and ``CheckpointError`` is raised, naming the round and directory."""
        current = self.checkpoint_dir / "state.json"
        previous = self.checkpoint_dir / "state.prev.json"
        arrays_name = f"state-{server_round:05d}.npz"
        tmp_npz = self.checkpoint_dir / "state.tmp.npz"
        tmp_json = current.with_suffix(".tmp")
        rotated, committed, old_previous = False, False, _read_or_none(previous)
        try:
            self.checkpoint_dir.mkdir(exist_ok=True)
            flat = {f"{group}/{key}": value for group, arrays in state.items() for key, value in arrays.items()}
            with open(tmp_npz, "wb") as handle:
                # cast: mypy checks **flat against savez's allow_pickle; names are "group/key", never "allow_pickle".
                np.savez(handle, **cast(dict[str, Any], flat))
                _fsync(handle)
            record = {"round": server_round, "strategy": strategy_name, "arrays": arrays_name, **meta}
            _write_synced(tmp_json, json.dumps(record, indent=2))
            os.replace(tmp_npz, self.checkpoint_dir / arrays_name)
            if self._is_whole(current):
                _write_durably(previous, current.read_text())
                rotated = True
            os.replace(tmp_json, current)
            committed = True
            _fsync_dir(self.checkpoint_dir)
        except OSError as err:
            if rotated and not committed:
                _restore(previous, old_previous)
            self._clean_up(tmp_npz, tmp_json, previous.with_suffix(".tmp"))
            if committed:  # only the directory's fsync failed
                message = f"checkpoint of round {server_round} in {self.checkpoint_dir} may not survive a crash: {err}"
            else:
                kept = _round_named(current) if self._is_whole(current) else _round_named(previous)
                message = f"checkpoint of round {server_round} not saved in {self.checkpoint_dir}: {err}; " + (
                    f"round {kept}'s is kept as it was" if kept is not None else "there is none before it"
                )
            if err.errno in _FULL:
                message += " (its disk is full: free space, then resume=true continues from the last checkpoint)"
            raise _os_error(CheckpointError, message, err) from err
        self._clean_up()

    def _is_whole(self, meta_path: Path) -> bool:
        """Whether ``meta_path`` (``state.json`` or ``state.prev.json``) is JSON naming arrays that exist."""
        name = _arrays_named(meta_path)
        return bool(name) and (self.checkpoint_dir / name).is_file()

    def _clean_up(self, *temporary: Path) -> None:
        """Remove ``temporary`` files and the arrays neither ``state.json`` nor ``state.prev.json`` names (those of
        older rounds, or of a round whose checkpoint failed), as far as it can: a file it cannot remove is logged."""
        named = {_arrays_named(self.checkpoint_dir / name) for name in ("state.json", "state.prev.json")}
        unnamed = [p for p in self.checkpoint_dir.glob("state-*.npz") if p.name not in named]
        for path in [*temporary, *unnamed]:
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                log.warning("checkpoint: could not remove %s: %s", path, err)

    def adapter_dir(self, name: str) -> Path:
        """Where a final adapter is saved: ``adapter/`` (one), else ``adapters/<name>/`` with ``name`` (a model
        family, from client-given model names) made one safe path component: it never leaves the run directory, and
        two names never share it. A name that is not already such a component (a leading dot, ``/``, ``..``, over
        ``_MAX_KEPT_NAME`` characters) is written ``<name made safe, cut>+<16 hex of its SHA-256>`` (``.smol`` ->
        ``smol+<hash>``, apart from ``smol``); ``+`` is in no name kept as it is."""
        if not name:
            return self.path / "adapter"
        component = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).lstrip(".") or "_"
        if component != name or len(name) > _MAX_KEPT_NAME:
            component = f"{component[: _MAX_KEPT_NAME // 2]}+{hashlib.sha256(name.encode()).hexdigest()[:16]}"
        return self.path / "adapters" / component

    def adapter_dirs(self, names: list[str]) -> dict[int, Path]:
        """Where each of the final adapters ``names`` is saved (``adapter_dir``), by position; one whose directory an
        earlier one already has (the same name twice, or a hash collision) is refused, logged naming both, and left
        out: the first is kept, never overwritten, and the rest are saved."""
        out: dict[int, Path] = {}
        owner: dict[Path, str] = {}
        for index, name in enumerate(names):
            target = self.adapter_dir(name)
            if target in owner:
                log.error("adapter %r not saved: %s is already %r's, kept as it is", name, target, owner[target])
                continue
            owner[target], out[index] = name, target
        return out

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

    # plots (common/plots.py: what every run has; a strategy draws its own) ----------------------------------
    def plot_eval_loss(self) -> Path | None:
        """``eval_loss.png``, or None (logged) if it cannot be drawn: a figure never stops a run."""
        out = self.path / "eval_loss.png"
        return plots.drawn(out.name, lambda: plots.eval_loss(self.read_metrics(), out), None)


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


def _round_named(meta_path: Path) -> Any:
    try:
        return json.loads(meta_path.read_text()).get("round")
    except (OSError, ValueError, AttributeError):
        return None


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # missing (or unreadable: then there is nothing to put back)
        return None


def _restore(path: Path, text: str | None) -> None:
    """Put ``path`` back as it was (``text``; None: it did not exist), as far as it can."""
    try:
        if text is None:
            path.unlink(missing_ok=True)
        else:
            _write_durably(path, text)
    except OSError as err:
        log.warning("checkpoint: could not put %s back: %s", path, err)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        _fsync(handle)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    _write_synced(tmp, text)
    os.replace(tmp, path)


def _probe(directory: Path) -> None:
    """Create, write, fsync and remove a small file in ``directory`` (an OSError if any step fails)."""
    probe = directory / f".tessera-write-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            if os.write(fd, b"\0" * _PROBE_BYTES) < _PROBE_BYTES:  # a short write: the disk filled up
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(probe))
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


def _not_writable(path: Path, err: OSError) -> OSError:
    if err.errno in _FULL:
        advice = "its disk is full: free space or choose another run-dir"
    else:
        advice = "choose another run-dir (run-dir=...) or make it writable by this user"
    return _os_error(RunDirNotWritableError, f"run-dir {path} is not writable ({err}): {advice}", err)


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


def _metrics_message(path: Path, what: str, err: OSError) -> str:
    message = f"{path}: {what}: {err}"
    if err.errno in _FULL:
        message += " (its disk is full: free space, then resume=true continues from the last checkpoint)"
    return message
