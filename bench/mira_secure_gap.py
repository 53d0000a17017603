"""How far MIRA's secure neighbour terms are from the exact ones, on one real run.

    python bench/mira_secure_gap.py --clients 6 --eta 0.5

Runs the same one-round MIRA federation (real 4-bit SmolLM2, BoolQ and ASDiv clients) twice, ``secure=false``
(one group per client: the server computes N_k = sum_l a_kl W_l exactly) and ``secure=true`` (groups of >= 3 of
the adjacency graph through SecAgg+: N_k from the group means). Round 1 trains from the same initial adapter with
the same seeds in both, so the clients' W_k are the same and the difference between the two checkpoints' N_k is
the secure approximation (plus SecAgg+'s quantisation). Writes ``bench/results/mira-secure-gap.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.local_sim import flwr_run, stop_superlink  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def neighbour_terms(run_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    out: dict[int, dict[str, np.ndarray]] = {}
    with np.load(run_dir / "checkpoint" / state["arrays"]) as data:
        for key in data.files:
            group, name = key.split("/", 1)
            if group.startswith("neighbours-"):
                out.setdefault(int(group.removeprefix("neighbours-")), {})[name] = data[key]
    return out


def run(work: Path, secure: bool, args) -> tuple[Path, list[dict], float]:
    run_dir = work / ("secure" if secure else "plain") / "run"
    home = work / ("secure" if secure else "plain") / "flwr-home"
    config = (
        f"strategy='mira' mira.eta={args.eta} secure={'true' if secure else 'false'} min-train-replies=3 "
        f"num-server-rounds=1 data.tasks='boolq,asdiv' train.local-steps={args.steps} eval.max-examples=8 "
        f"eval.max-new-tokens=4 fingerprint.batches={args.batches} run-dir='{run_dir}'"
    )
    started = time.perf_counter()
    try:
        proc = flwr_run(home, config, num_clients=args.clients, timeout=3600)
    finally:
        stop_superlink(home)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return run_dir, rows, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--eta", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain_dir, plain_rows, plain_s = run(Path(tmp), False, args)
        secure_dir, secure_rows, secure_s = run(Path(tmp), True, args)
        exact, grouped = neighbour_terms(plain_dir), neighbour_terms(secure_dir)
        aggregate = next(r for r in secure_rows if r["round"] == 1 and r["node"] is None)
        groups = next(iter(aggregate["mira"].values()))["groups"]
    per_client = {}
    for pid in sorted(exact):
        diff = np.concatenate([(grouped[pid][k] - exact[pid][k]).ravel() for k in exact[pid]])
        ref = np.concatenate([exact[pid][k].ravel() for k in exact[pid]])
        per_client[pid] = {
            "relative_l2": float(np.linalg.norm(diff) / np.linalg.norm(ref)),
            "max_abs": float(np.abs(diff).max()),
        }
    loss = {
        mode: {r["partition_id"]: r["eval_loss"] for r in rows if r["round"] == 1 and r["node"] is not None}
        for mode, rows in (("plain", plain_rows), ("secure", secure_rows))
    }
    result = {
        "clients": args.clients,
        "eta": args.eta,
        "secure_groups": groups,
        "neighbour_term_gap": per_client,
        "eval_loss_round1": loss,
        "seconds": {"plain": plain_s, "secure": secure_s},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mira-secure-gap.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"MIRA secure vs exact neighbour terms: {args.clients} clients (BoolQ / ASDiv), eta {args.eta}, one round, "
        f"SmolLM2-135M NF4 on CPU ({time.strftime('%Y-%m-%d')}); secure groups {groups}.",
        "",
        "| partition | ||N_secure - N_exact|| / ||N_exact|| | max abs diff | held-out loss plain | secure |",
        "| --- | --- | --- | --- | --- |",
    ]
    for pid, gap in per_client.items():
        lines.append(
            f"| {pid} | {gap['relative_l2']:.4f} | {gap['max_abs']:.2e} | {loss['plain'].get(pid, float('nan')):.4f} "
            f"| {loss['secure'].get(pid, float('nan')):.4f} |"
        )
    (RESULTS / "mira-secure-gap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
