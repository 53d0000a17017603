"""Live curves for an operator: every round's metrics rows, as they are written to ``metrics.jsonl``, also go to
TensorBoard event files under ``<run-dir>/tensorboard`` (``tensorboard --logdir <run-dir>/tensorboard``), so a
multi-hour run can be watched while it goes: each client's held-out and training loss, whether its update was
accepted, the privacy it has spent, its guard's share, tokens/s and bytes, and the round's mean, refusals, seconds and
bytes; then each strategy's own signals: every number in its diagnostics (``Strategy.report``, e.g. VEMoE's expert
count and responsibilities, ATLAS's cluster scores and purity) under ``strategy/``, and every plot it draws for the
round (``Strategy.plot_round``: SimGrad's relevance matrix, ATLAS's clusters and ranks, MIRA's graph) as an image.

Written with tensorboardX (the ``monitor`` extra: ``pip install -e ".[monitor]"``; ``scripts/setup.sh`` installs it).
Without it, or with ``live-curves=false``, nothing is written and the run says so once. A curve that cannot be
written never stops a run: the first failure is logged and the curves stop.
"""

from __future__ import annotations

import math
import re
import secrets
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from common.logs import get_logger

log = get_logger("tessera.server")

# client rows: (metrics key, TensorBoard tag under client/<partition>/)
CLIENT_CURVES = (
    ("eval_loss", "eval_loss"),
    ("train_loss", "train_loss"),
    ("exact_match", "exact_match"),
    ("update_norm", "update_norm"),
    ("dp_record_epsilon", "record_epsilon"),
    ("dp_member_epsilon", "member_epsilon"),
    ("guard_share", "guard_share"),
    ("tokens_per_second", "tokens_per_second"),
    ("bytes_up", "bytes_up"),
    ("bytes_down", "bytes_down"),
)
# the round's aggregate row: (metrics key, tag under round/)
ROUND_CURVES = (
    ("eval_loss", "eval_loss"),
    ("exact_match", "exact_match"),
    ("rouge_l", "rouge_l"),
    ("seconds", "seconds"),
    ("bytes_up", "bytes_up"),
    ("bytes_down", "bytes_down"),
    ("dp_epsilon", "dp_epsilon"),
    ("server_rss_mb", "server_rss_mb"),
)


# a strategy's diagnostics are its to shape: at most this many of its numbers a round become curves (a report
# over thousands of clients stays a readable board, and the rest is in metrics.jsonl)
MAX_STRATEGY_CURVES = 256
_ROUND_IN_NAME = re.compile(r"[-_]?round-(\d+)")


def strategy_numbers(row: dict[str, Any]) -> list[tuple[str, Any]]:
    """(tag, value) for the numbers of the strategy's diagnostics in an aggregate row: the leaves of every entry
    that is a mapping (the shape ``Strategy.report`` gives them: ``{"vemoe": {"experts": 3, ...}}``), a list of
    fractions as one curve per position; lists of ids or labels (whole numbers) and matrices are left to
    ``metrics.jsonl`` and the plots."""
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}", inner)
        elif isinstance(value, list) and any(isinstance(v, float) for v in value):
            out.extend((f"{prefix}/{i}", v) for i, v in enumerate(value) if not isinstance(v, list | dict))
        elif not isinstance(value, list):
            out.append((prefix, value))

    for key, value in row.items():
        if isinstance(value, dict) and key not in ("rejected", "excluded"):
            walk(f"strategy/{key}", value)
    return out[:MAX_STRATEGY_CURVES]


def scalars(rows: Iterable[dict[str, Any]]) -> list[tuple[str, float, int]]:
    """(tag, value, round) for every number worth a curve in a round's metrics rows."""
    out: list[tuple[str, float, int]] = []
    for row in rows:
        step = int(row["round"])
        if row.get("node") is None:
            pairs = [(f"round/{tag}", row.get(key)) for key, tag in ROUND_CURVES]
            pairs.append(("round/replies_refused", len(row.get("rejected") or {})))
            pairs += strategy_numbers(row)
        else:
            who = f"client/{row.get('partition_id', row['node'])}"
            pairs = [(f"{who}/{tag}", row.get(key)) for key, tag in CLIENT_CURVES]
            if "accepted" in row:
                pairs.append((f"{who}/update_accepted", 1.0 if row["accepted"] else 0.0))
        for tag, value in pairs:
            if isinstance(value, bool | int | float) and math.isfinite(float(value)):
                out.append((tag, float(value), step))
    return out


class LiveCurves:
    """TensorBoard event files of a run directory, one point per curve and round (see the module docstring).

    tensorboardX's record writer and protos, written synchronously (its ``SummaryWriter`` queues events to a
    thread: a flushed round could still be in memory when an operator looks, or when the run is killed)."""

    def __init__(self, directory: Path, enabled: bool = True) -> None:
        self.directory = directory
        self._file: Any = None
        if not enabled:
            return
        try:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.record_writer import RecordWriter
        except ImportError:
            log.info("live curves: tensorboardX is not installed (pip install -e '.[monitor]'); metrics.jsonl only")
            return
        self._event, self._image = Event, Summary.Image
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # a file of its own: a resumed run (even in the same second) adds a file beside the curves so far
            name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{secrets.token_hex(4)}"
            self._file = RecordWriter(str(directory / name))
            self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        except OSError as err:
            log.warning("live curves: %s cannot be written (%s); metrics.jsonl only", directory, err)
            self._file = None
            return
        log.info("live curves: tensorboard --logdir %s", directory)

    def _write(self, event: Any) -> None:
        self._file.write(event.SerializeToString())

    def _emit(self, events: Iterable[Any]) -> None:
        """Write ``events`` and flush (fsync) them; the first failure is logged and the curves stop, the run goes on."""
        if self._file is None:
            return
        try:
            for event in events:
                self._write(event)
            self._file.flush()
        except Exception as err:  # a curve never stops a run
            log.warning("live curves stopped: %s: %s", type(err).__name__, err)
            self.close()

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """One round's rows (those ``metrics.jsonl`` just got); on disk (fsynced) before it returns."""
        self._emit(self._scalar_events(rows))

    def _scalar_events(self, rows: Iterable[dict[str, Any]]) -> Iterable[Any]:
        now = time.time()
        for tag, value, step in scalars(rows):
            event = self._event(wall_time=now, step=step)
            event.summary.value.add(tag=tag, simple_value=value)
            yield event

    def add_images(self, server_round: int, paths: Iterable[Path], run_dir: Path) -> None:
        """A round's plots (PNG files under ``run_dir``) as images, each tagged by its path without the round
        (``relevance/round-003.png`` -> ``plots/relevance``), so a board's slider steps through the rounds."""
        self._emit(self._image_events(server_round, paths, run_dir))

    def _image_events(self, server_round: int, paths: Iterable[Path], run_dir: Path) -> Iterable[Any]:
        for path in paths:
            if path.suffix != ".png" or not path.is_file():
                continue
            data = path.read_bytes()
            width, height = struct.unpack(">II", data[16:24])  # the PNG header's IHDR
            parts = [
                _ROUND_IN_NAME.sub("", part).strip("-_") for part in path.relative_to(run_dir).with_suffix("").parts
            ]
            event = self._event(wall_time=time.time(), step=server_round)
            event.summary.value.add(
                tag="plots/" + "/".join(part for part in parts if part),
                image=self._image(height=height, width=width, colorspace=4, encoded_image_string=data),
            )
            yield event

    def add_kept_images(self, run_dir: Path, last_round: int) -> None:
        """On a resume: the plots the run drew before (up to ``last_round``, the last one kept), each at its round."""
        by_round: dict[int, list[Path]] = {}
        for path in sorted(run_dir.rglob("*.png")):
            found = _ROUND_IN_NAME.search(path.name)
            if found and "tensorboard" not in path.relative_to(run_dir).parts and int(found.group(1)) <= last_round:
                by_round.setdefault(int(found.group(1)), []).append(path)
        for server_round, paths in sorted(by_round.items()):
            self.add_images(server_round, paths, run_dir)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            finally:
                self._file = None
