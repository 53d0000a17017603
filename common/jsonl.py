"""Append-only JSON-lines files that survive a kill: what the privacy ledgers (``server_app.ledger``,
``client_app.member_ledger``) are written with.

``append_durably`` writes one line and fsyncs it (and the directory, for a new file) before it returns, so what it
recorded is on the disk before the caller goes on to send anything. A kill while appending leaves a torn last line:
``whole_lines`` skips it, and the next append starts on a line of its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_durably(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line and fsync it; an ``OSError`` if the disk refuses."""
    new = not path.exists()
    with open(path, "a+") as handle:
        handle.seek(0, os.SEEK_END)
        torn = False
        if handle.tell():
            handle.seek(handle.tell() - 1)
            torn = handle.read(1) != "\n"
        handle.write(("\n" if torn else "") + json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    if new:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def whole_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every line of ``path`` that is a JSON object, and how many were not (torn by a kill while appending)."""
    if not path.exists():
        return [], 0
    records, torn = [], 0
    for text in path.read_text().splitlines():
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            torn += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            torn += 1
    return records, torn
