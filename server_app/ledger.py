"""The server's privacy ledger: every round's release, written durably before the round's first train instruction.

``<run-dir>/privacy-ledger.jsonl`` holds one line per round that was started: the run it belongs to, the round, and
the noise multiplier of what that round releases (0 for a round without ``dp.*``: the accountant reads it as
epsilon infinity). A line is appended and fsynced before any member is asked to train, so a round that was released
and then lost (a crash, a failed metrics write, a SIGKILL before the checkpoint) is already counted, and the round
redone after ``resume=true`` is counted again: two releases, two lines. Nothing ever removes a line: a resume keeps
them all, and a fresh run (``resume=false``) in the same run directory starts a run of its own below them.

The epsilon a run reports composes every line of its run (``noise_multipliers``); rounds a checkpoint says were done
but the ledger does not hold (a checkpoint of an older Tessera) are counted as released without noise
(``unrecorded``). The member's own ledger, on its node, is ``client_app.member_ledger``.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from common.jsonl import append_durably, whole_lines
from common.logs import get_logger

log = get_logger("tessera.server")

LEDGER_NAME = "privacy-ledger.jsonl"


class LedgerError(OSError):
    """A round's release could not be recorded: the round must not start (nothing is sent)."""


class PrivacyLedger:
    """The append-only ledger of one run directory (see the module docstring); ``run`` names this run's lines, read
    once here and kept as they are appended (this process is the run's only writer)."""

    def __init__(self, run_dir: Path, run: str | None = None) -> None:
        self.path = Path(run_dir) / LEDGER_NAME
        self.run = run or f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._noise = [float(e["noise_multiplier"]) for e in self.entries() if e.get("run") == self.run]

    def entries(self) -> list[dict[str, Any]]:
        """Every whole line of the ledger (a torn last line, from a crash while appending, is not a release that
        went out: its round's instructions are only sent once the line is fsynced)."""
        entries, torn = whole_lines(self.path)
        if torn:
            log.warning(
                "%s: %d torn line(s) (a crash while writing them): those rounds were not started", self.path, torn
            )
        return entries

    def noise_multipliers(self) -> list[float]:
        """This run's noise multiplier per release, in order (what the accountant composes)."""
        return list(self._noise)

    def record(self, server_round: int, noise_multiplier: float, **about: Any) -> None:
        """Append round ``server_round``'s release and fsync it (and the directory, for the file's first line);
        ``LedgerError`` if the disk refuses: then the round must not go out."""
        line = {"run": self.run, "round": server_round, "noise_multiplier": float(noise_multiplier), **about}
        try:
            append_durably(self.path, {**line, "time": time.time()})
        except OSError as err:
            failed = LedgerError(
                f"round {server_round} not started: its release could not be recorded in {self.path} ({err}); "
                "resume=true continues from the last checkpoint once it can"
            )
            failed.errno = err.errno
            raise failed from err
        self._noise.append(float(noise_multiplier))

    def unrecorded(self, rounds_done: int, checkpoint_noise: list[float]) -> None:
        """On resume: make the ledger hold at least the ``rounds_done`` releases the checkpoint says happened. Rounds
        it lacks (a checkpoint written before the ledger existed) are recorded with the checkpoint's noise list when
        that names every round, else with 0 (released without noise: epsilon infinity), never as nothing."""
        held = len(self._noise)
        if held >= rounds_done:
            return
        known = checkpoint_noise if len(checkpoint_noise) == rounds_done else []
        for server_round in range(held + 1, rounds_done + 1):
            z = known[server_round - 1] if known else 0.0
            self.record(server_round, z, source="checkpoint" if known else "unrecorded")
        log.warning(
            "privacy ledger: rounds %d-%d were not in %s; recorded from the checkpoint%s",
            held + 1,
            rounds_done,
            self.path,
            "" if known else " as released without noise (epsilon infinity)",
        )
