"""Scale benchmark: many simulated clients, a few sampled per round, on the real 4-bit model.

    python bench/scale_bench.py                              # the issue's grid (long: see below)
    python bench/scale_bench.py --grid 10/10,1000/10 --strategies fedavg --modes plain --rounds 2

Each grid item is ``TOTAL/SAMPLED``: ``num-supernodes=TOTAL`` in Flower's simulation with ``fraction-train`` and
``fraction-evaluate`` set so that SAMPLED clients train and are evaluated per round (``evaluate-all-every=0``: the
others never run). Per run and round it reads the run's ``metrics.jsonl``: the round's wall time, the ServerApp
process's resident memory after the round (``server_rss_mb``), the clients' peak RSS, adapter bytes up and down
over all the round's clients, how many clients trained and how many model loads the round cost (one per Ray actor
process: the base model is loaded once per actor and reused for every client it serves). Round 1 carries the model
loads; the steady state is the mean of the later rounds.

Writes ``bench/results/scale.json`` (with the machine it ran on) and prints a Markdown table, one row per (strategy,
mode, total, sampled), with the server's memory per idle client estimated from the runs that differ only in TOTAL and
what SecAgg+ adds to a round where a grid item ran both plain and secure. ``--table A.json B.json ...`` prints the same
table for reports written by several invocations, without running anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare_merge import machine, machine_name  # noqa: E402
from deploy.local_sim import flwr_run, prepare_home, stop_superlink  # noqa: E402

DEFAULT_GRID = "10/10,100/10,1000/10,1000/5,1000/20"
# one short local task per sampled client: the benchmark measures the federation, not the learning. A bank of 1,000
# examples a task gives each of 1,000 clients 4 (with the default 400, 400 of them hold 1 and are left out at
# admission); the 250 clients of a task share its test examples, at the default 20 % too few (185-220 a task): 30 %
WORKLOAD = (
    "train.local-steps=2 eval.max-examples=4 eval.generate-examples=1 eval.max-new-tokens=4 "
    "data.max-examples-per-task=1000 data.test-fraction=0.3"
)


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``"10/10,1000/5"`` -> ``[(10, 10), (1000, 5)]``; SAMPLED must be at least 3 (a secure group) and <= TOTAL."""
    grid = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        total, _, sampled = item.partition("/")
        pair = (int(total), int(sampled or total))
        if not 3 <= pair[1] <= pair[0]:
            raise SystemExit(f"--grid item {item!r}: need 3 <= SAMPLED <= TOTAL")
        grid.append(pair)
    return grid


def run_config(total: int, sampled: int, strategy: str, secure: bool, rounds: int, run_dir: Path, extra: str) -> str:
    fraction = sampled / total
    return (
        f"strategy='{strategy}' secure={'true' if secure else 'false'} num-server-rounds={rounds} "
        f"fraction-train={fraction!r} fraction-evaluate={fraction!r} min-train-nodes={sampled} "
        f"min-evaluate-nodes={sampled} evaluate-all-every=0 min-train-replies=3 run-dir='{run_dir}' {WORKLOAD} {extra}"
    )


def summarise(rows: list[dict]) -> list[dict]:
    """Per training round (round 0 is the first evaluation; it is left out): what one round cost."""
    out = []
    pids_seen: set = set()
    for rnd in sorted({r["round"] for r in rows if r["round"] > 0}):
        clients = [r for r in rows if r["round"] == rnd and r["node"] is not None]
        agg = next(r for r in rows if r["round"] == rnd and r["node"] is None)
        pids = {r.get("pid") for r in clients} - {None}
        out.append(
            {
                "round": rnd,
                "wall_seconds": agg["seconds"],
                "trained": sum(1 for r in clients if r.get("accepted")),
                "evaluated": sum(1 for r in clients if r.get("eval_loss") is not None),
                "server_rss_mb": agg.get("server_rss_mb"),
                "peak_client_rss_mb": max((r.get("peak_rss_mb") or 0.0) for r in clients),
                # the largest state one client keeps between rounds (held per client in Flower's simulation state)
                "client_state_kb": max((r.get("state_bytes") or 0) for r in clients) / 1e3,
                "bytes_up": sum(r.get("bytes_up") or 0 for r in clients),
                "bytes_down": sum(r.get("bytes_down") or 0 for r in clients),
                "actor_processes": len(pids),
                "new_processes": len(pids - pids_seen),
                "eval_loss": agg.get("eval_loss"),
            }
        )
        pids_seen |= pids
    return out


def outside_rounds(rows: list[dict], run_seconds: float) -> float:
    """Seconds of ``flwr run`` outside every round, round 0's evaluation included: starting Flower and its Ray
    actors, admitting every client (one query each, so this grows with TOTAL), writing the outputs."""
    return run_seconds - sum(r["seconds"] for r in rows if r["node"] is None)


def steady(rounds: list[dict]) -> dict:
    """The later rounds' mean (round 1 pays the model loads), or round 1 when it is the only one."""
    later = rounds[1:] or rounds
    keys = ("wall_seconds", "server_rss_mb", "peak_client_rss_mb", "bytes_up", "bytes_down")
    return {k: sum((r[k] or 0.0) for r in later) / len(later) for k in keys} | {
        "server_rss_mb_max": max((r["server_rss_mb"] or 0.0) for r in rounds),
        "trained": rounds[-1]["trained"],
        "evaluated": rounds[-1]["evaluated"],
        "client_state_kb": max(r.get("client_state_kb", 0.0) for r in rounds),
        "actor_processes": max(r["actor_processes"] for r in rounds),
    }


def _mean_by(results: list[dict], key: tuple[str, ...], value) -> dict[tuple, float]:
    """The mean of ``value(run)`` over the runs that share ``key`` (a grid item run more than once counts once)."""
    groups: dict[tuple, list[float]] = {}
    for res in results:
        groups.setdefault(tuple(res[k] for k in key), []).append(value(res))
    return {k: sum(v) / len(v) for k, v in groups.items()}


def idle_client_memory(results: list[dict]) -> dict[str, float]:
    """Server MB per idle client, from runs equal but for TOTAL: (RSS at the largest - at the smallest) / extra;
    repeated runs of one grid item are averaged first."""
    rss = _mean_by(results, ("strategy", "mode", "sampled", "total"), lambda r: r["steady"]["server_rss_mb_max"])
    out = {}
    for strategy, mode, sampled in sorted({k[:3] for k in rss}):
        totals = sorted(k[3] for k in rss if k[:3] == (strategy, mode, sampled))
        if len(totals) > 1:
            lo, hi = totals[0], totals[-1]
            growth = rss[strategy, mode, sampled, hi] - rss[strategy, mode, sampled, lo]
            out[f"{strategy}/{mode}/{sampled} sampled"] = growth / (hi - lo)
    return out


def secure_overhead(results: list[dict]) -> dict[str, float]:
    """What SecAgg+ adds to a steady round, as a fraction of the plain round, per (strategy, total, sampled) that ran
    in both modes (repeated runs averaged)."""
    seconds = _mean_by(results, ("strategy", "mode", "total", "sampled"), lambda r: r["steady"]["wall_seconds"])
    out = {}
    for (strategy, mode, total, sampled), secure in seconds.items():
        plain = seconds.get((strategy, "plain", total, sampled))
        if mode == "secure" and plain is not None:
            out[f"{strategy} {total}/{sampled}"] = secure / plain - 1.0
    return out


def print_report(report: dict) -> None:
    """The Markdown table, then memory per idle client and the secure overhead."""
    where = report.get("machine")
    if isinstance(where, dict):
        where = machine_name(where)
    print(f"machine: {where}; {report['rounds']} rounds")
    print(HEADER)
    for result in report["runs"]:
        print(_row(result))
    for key, value in idle_client_memory(report["runs"]).items():
        print(f"server memory per idle client ({key}): {value:.3f} MB")
    for key, value in secure_overhead(report["runs"]).items():
        print(f"SecAgg+ adds to a round ({key}): {100 * value:+.0f} %")


def join_reports(paths: list[str]) -> dict:
    """Several invocations' reports as one (they must share the machine and the number of rounds)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    for key in ("machine", "rounds"):
        if any(r.get(key) != reports[0].get(key) for r in reports):
            raise SystemExit(f"--table: the reports differ in {key!r}; join only runs of one machine and length")
    return {
        "machine": reports[0].get("machine"),
        "rounds": reports[0]["rounds"],
        "runs": [run for r in reports for run in r["runs"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", default=DEFAULT_GRID, help="TOTAL/SAMPLED items, comma-separated")
    parser.add_argument("--strategies", default="fedavg,simgrad")
    parser.add_argument("--modes", default="plain,secure")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-cpus", type=int, default=None, help="CPUs per Ray actor (Flower's default 2)")
    parser.add_argument("--extra", default="", help="more --run-config overrides")
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale.json"))
    parser.add_argument("--table", nargs="+", metavar="REPORT", help="print the table of these reports; run nothing")
    args = parser.parse_args()
    if args.table:
        print_report(join_reports(args.table))
        return

    work = Path(tempfile.mkdtemp(prefix="tessera-scale-"))
    home = prepare_home(work / "flwr-home")
    report: dict = {"machine": machine(), "rounds": args.rounds, "runs": []}
    try:
        for strategy in args.strategies.split(","):
            for mode in args.modes.split(","):
                for total, sampled in parse_grid(args.grid):
                    run_dir = work / f"{strategy}-{mode}-{total}-{sampled}"
                    cfg = run_config(total, sampled, strategy, mode == "secure", args.rounds, run_dir, args.extra)
                    started = time.perf_counter()
                    proc = flwr_run(home, cfg, num_clients=total, timeout=args.timeout, client_cpus=args.client_cpus)
                    if proc.returncode != 0:
                        raise SystemExit(f"{strategy} {mode} {total}/{sampled} failed:\n{proc.stdout[-3000:]}")
                    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                    rounds = summarise(rows)
                    run_seconds = time.perf_counter() - started
                    result = {
                        "strategy": strategy,
                        "mode": mode,
                        "total": total,
                        "sampled": sampled,
                        "run_seconds": run_seconds,
                        "outside_rounds_seconds": outside_rounds(rows, run_seconds),
                        "rounds": rounds,
                        "steady": steady(rounds),
                    }
                    report["runs"].append(result)
                    print(_row(result), flush=True)
    finally:
        stop_superlink(home)
    report["server_mb_per_idle_client"] = idle_client_memory(report["runs"])
    report["secure_overhead"] = secure_overhead(report["runs"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"written to {args.out}")


HEADER = (
    "| strategy | mode | clients | sampled | trained / evaluated | round s (steady) | round 1 s | outside rounds s | "
    "server RSS MB | client peak RSS MB | state KB / client | actor processes | KB up/round | KB down/round |\n|"
    + "---|"
    * 14
)


def _row(res: dict) -> str:
    s = res["steady"]
    evaluated = s.get("evaluated", res["rounds"][-1]["evaluated"])
    return (
        f"| {res['strategy']} | {res['mode']} | {res['total']:,} | {res['sampled']} | {s['trained']} / {evaluated} | "
        f"{s['wall_seconds']:.1f} | {res['rounds'][0]['wall_seconds']:.1f} | {_outside(res)} | "
        f"{s['server_rss_mb_max']:.0f} | {s['peak_client_rss_mb']:,.0f} | {_state_kb(s)} | {s['actor_processes']} | "
        f"{s['bytes_up'] / 1e3:,.0f} | {s['bytes_down'] / 1e3:,.0f} |"
    )


def _outside(res: dict) -> str:
    return f"{res['outside_rounds_seconds']:.0f}" if "outside_rounds_seconds" in res else "n/a"


def _state_kb(steady_round: dict) -> str:
    """Older reports predate ``state_bytes``: their state column is unknown, not 0."""
    return f"{steady_round['client_state_kb']:,.0f}" if "client_state_kb" in steady_round else "n/a"


if __name__ == "__main__":
    main()
