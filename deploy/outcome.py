"""Whether a `flwr run` did what it was asked: Flower 1.42's `flwr run --stream` exits 0 when the ServerApp raised (a
refused run config, data no node could read, a federation that lost its quorum), so a script, CI job or scheduler
would read a failed run as success. The SuperLink knows better: it records the run as ``finished:failed`` with the
exception, and `flwr ls --run-id` reports it.

    flwr run . local --stream 2>&1 | tee run.log; python -m deploy.outcome local run.log

prints the run's status and exits 0 only when it is ``finished:completed`` (1 when failed or stopped, 2 when the log
names no run or the SuperLink cannot say). ``checked`` does the same for a finished ``subprocess.run`` of `flwr run`
(``deploy.local_sim.flwr_run``, ``deploy.loopback``), so every caller in this repository sees a failed run fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

COMPLETED = "finished:completed"
# `flwr run --stream` logs "Starting logstream for run_id `<id>`"; `flwr run --format json` prints "run-id"
_RUN_ID = re.compile(r"run_id `(\d+)`|\"run-id\":\s*\"?(\d+)")


def run_id_in(output: str) -> int | None:
    """The id of the run a `flwr run` started, from what it printed (None: it started none)."""
    match = _RUN_ID.search(output)
    return None if match is None else int(match.group(1) or match.group(2))


def run_status(connection: str, run_id: int, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(status, details) of ``run_id`` as the SuperLink of ``connection`` records it (``flwr ls``); ("unknown", why)
    when it cannot say."""
    cmd = ["flwr", "ls", connection, "--run-id", str(run_id), "--format", "json"]
    try:
        done = subprocess.run(cmd, env=dict(env) if env else None, capture_output=True, text=True, timeout=120)
        runs = json.loads(done.stdout).get("runs") or []
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as err:
        return "unknown", f"flwr ls gave no answer ({type(err).__name__})"
    if not runs:
        return "unknown", f"the SuperLink of '{connection}' lists no run {run_id}"
    return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))


def verdict(output: str, connection: str, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(exit code, the line that says why) for a `flwr run` that printed ``output``."""
    run_id = run_id_in(output)
    if run_id is None:
        return 2, "no run was started (see the output above)"
    status, details = run_status(connection, run_id, env)
    line = f"run {run_id}: {status}" + (f": {details}" if details and status != COMPLETED else "")
    if status == COMPLETED:
        return 0, line
    return (2 if status == "unknown" else 1), line


def checked(
    done: subprocess.CompletedProcess, connection: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``done`` (a finished `flwr run`) with the return code the run deserves: non-zero, and the reason at the end of
    its stderr, where the SuperLink records the run as anything but completed."""
    if done.returncode != 0:
        return done
    code, line = verdict(done.stdout + done.stderr, connection, env)
    if code == 0:
        return done
    return subprocess.CompletedProcess(done.args, code, done.stdout, f"{done.stderr}\n[tessera] {line}\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    code, line = verdict(Path(args[1]).read_text(errors="replace"), args[0])
    print(f"[tessera] {line}", file=sys.stderr if code else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
