"""What a fresh process costs before it works: the CPU seconds of importing each stack in a new interpreter.

    python -m bench.startup_bench --repeats 3

Each case runs ``--repeats`` times in a fresh ``python -c`` (its CPU time from ``getrusage`` of the finished child:
user + system, the figure that matters on a machine whose cores are all busy); the median and range are printed and
written to ``bench/results/startup.json``. ``bitsandbytes first`` imports bitsandbytes before ``common`` and so
without ``common.bnb_import``'s deferral: what every process paid before it. A ClientApp's Ray actor and a node's
model worker import ``client_app.handlers``; Flower starts a ``flwr-clientapp`` process for every message in
deployment.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "python": "pass",
    "torch": "import torch",
    "peft (deferral on)": "import common, peft",
    "peft (bitsandbytes first)": "import bitsandbytes, common, peft",
    "client handlers (deferral on)": "import client_app.handlers",
    "client handlers (bitsandbytes first)": "import bitsandbytes, client_app.handlers",
    "server app": "import server_app.app",
    "Flower's flwr-clientapp": "import flwr.supernode.cli.flwr_clientapp",
}


def cpu_seconds(code: str) -> float:
    """User + system CPU seconds of a fresh interpreter running ``code`` in the project root."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup.json")
    args = parser.parse_args(argv)
    results = {}
    for name, code in CASES.items():
        cpu_seconds(code)  # once untimed: the same file cache for every case
        runs = [cpu_seconds(code) for _ in range(args.repeats)]
        results[name] = {"code": code, "cpu_seconds": runs, "median": statistics.median(runs)}
        print(f"{name:40s} {statistics.median(runs):6.2f} s CPU ({min(runs):.2f}-{max(runs):.2f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
