"""Record-level DP-SGD against none, on the demo's federation: does every client still learn?

    python -m bench.dpsgd_pilot [--epsilons 8] [--rounds 2] [--steps 8] [--batch 2] [--strategy fedavg]
                                [--out docs/results/dpsgd-pilot/pilot.json]

``flwr run . local`` (3 clients, the demo's data: ASDiv + CommonsenseQA, BoolQ, XSum), plain, one run per epsilon
(``dp.record-epsilon``: every member's default target, each member calibrating its own noise for the planned rounds
x steps) and one without DP, seed 0. Writes every client's held-out loss by round and what it spent. One seed and a
few rounds: a pilot of the cost, not a verdict (docs/privacy.md says which measurement is still to be made).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from deploy.local_sim import flwr_run, prepare_home, stop_superlink

KEPT = (
    "eval_loss",
    "dp_record_epsilon",
    "dp_record_noise_multiplier",
    "dp_record_sampling_rate",
    "tasks",
    "data_train",
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilons", default="8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--out", default="docs/results/dpsgd-pilot/pilot.json")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dpsgd-pilot-"))
    home = prepare_home(work / "home")
    lean = (
        f"strategy='{args.strategy}' num-server-rounds={args.rounds} train.local-steps={args.steps} "
        f"train.batch-size={args.batch} eval.max-examples=16 eval.generate-examples=1 eval.max-new-tokens=4"
    )
    runs = {f"epsilon-{e}": f"dp.record-epsilon={float(e)}" for e in args.epsilons.split(",")} | {"none": ""}
    report: dict = {"settings": lean, "runs": list(runs), "clients": {}}
    try:
        for name, extra in runs.items():
            run_dir = work / name
            done = flwr_run(home, f"{lean} {extra} run-dir='{run_dir}'", timeout=3600)
            if done.returncode != 0:
                raise RuntimeError(f"{name}: {(done.stdout + done.stderr)[-2000:]}")
            for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                row = json.loads(line)
                if row["node"] is not None:
                    client = report["clients"].setdefault(str(row["partition_id"]), {})
                    client.setdefault(name, {})[str(row["round"])] = {k: row.get(k) for k in KEPT}
    finally:
        stop_superlink(home)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"[dpsgd_pilot] wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
