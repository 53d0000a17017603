"""Live curves for an operator: every round's metrics rows, as they are written to ``metrics.jsonl``, also go to
TensorBoard event files under ``<run-dir>/tensorboard`` (``tensorboard --logdir <run-dir>/tensorboard``), so a
multi-hour run can be watched while it goes: each client's held-out and training loss, whether its update was
accepted, the privacy it has spent, and the round's mean, refusals, seconds and bytes.

Written with tensorboardX (the ``monitor`` extra: ``pip install -e ".[monitor]"``; ``scripts/setup.sh`` installs it).
Without it, or with ``live-curves=false``, nothing is written and the run says so once. A curve that cannot be
written never stops a run: the first failure is logged and the curves stop.
"""

from __future__ import annotations

import math
import secrets
import socket
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
)
# the round's aggregate row: (metrics key, tag under round/)
ROUND_CURVES = (
    ("eval_loss", "eval_loss"),
    ("exact_match", "exact_match"),
    ("rouge_l", "rouge_l"),
    ("seconds", "seconds"),
    ("bytes_up", "bytes_up"),
    ("dp_epsilon", "dp_epsilon"),
    ("server_rss_mb", "server_rss_mb"),
)


def scalars(rows: Iterable[dict[str, Any]]) -> list[tuple[str, float, int]]:
    """(tag, value, round) for every number worth a curve in a round's metrics rows."""
    out: list[tuple[str, float, int]] = []
    for row in rows:
        step = int(row["round"])
        if row.get("node") is None:
            pairs = [(f"round/{tag}", row.get(key)) for key, tag in ROUND_CURVES]
            pairs.append(("round/replies_refused", len(row.get("rejected") or {})))
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
            from tensorboardX.record_writer import RecordWriter
        except ImportError:
            log.info("live curves: tensorboardX is not installed (pip install -e '.[monitor]'); metrics.jsonl only")
            return
        self._event = Event
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

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """One round's rows (those ``metrics.jsonl`` just got); on disk (fsynced) before it returns."""
        if self._file is None:
            return
        try:
            now = time.time()
            for tag, value, step in scalars(rows):
                event = self._event(wall_time=now, step=step)
                event.summary.value.add(tag=tag, simple_value=value)
                self._write(event)
            self._file.flush()
        except Exception as err:  # a curve never stops a run
            log.warning("live curves stopped: %s: %s", type(err).__name__, err)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            finally:
                self._file = None
