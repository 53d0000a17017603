"""Compare strategies on the same clients, partition and budget, over seeds, through the real `flwr run . local`.

    python -m bench.compare --strategies fedavg,simgrad,local --seeds 0,1,2 --preset tasks-distinct --out DIR

Every flag is optional (the preset's values by default). ``--strategies`` items are ``name`` or
``name:key=value key=value`` (run-config overrides for that strategy only, e.g. ``simgrad:pqlora.learning-rate=0.02``;
commas inside quotes are kept); ``--run-config`` adds overrides for every run. Writes to ``--out``:
``compare.json`` (per strategy, seed, client and round: held-out loss, EM, ROUGE-L, bytes up/down, seconds),
``compare.md`` (mean ± spread over seeds per strategy, negative transfer against ``local``, the best per column in
bold; then every strategy's paired worst- and mean-client differences against ``--references`` with bootstrap
intervals over held-out examples and a verdict, ``bench.stats``) and ``compare.png``; the verdicts are printed
too. A run whose directory already holds a complete run with the same settings is reused.
``--merge`` adds the runs of an earlier ``compare.json`` (same preset, budget and run config; other seeds or other
strategies, e.g. from another machine; pairs are formed on the seeds both strategies ran) to the report, which names
the machine every seed (and strategy) ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.presets import PRESETS, Preset, preset, toml_value
from bench.report import markdown_table, per_client_table, summarise, verdict_tables, worst_by_round

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"  # the app's defaults
ROW_KEYS = (
    "eval_loss",
    "exact_match",
    "rouge_l",
    "bytes_up",
    "bytes_down",
    "peak_rss_mb",
    "train_seconds",
    "eval_seconds",
    "eval_examples",
    "eval_example_loss",  # per held-out example, what the verdicts bootstrap over
    "eval_example_tokens",
)


def split_outside_quotes(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` where it is not inside single or double quotes; empty items dropped."""
    items, current, quote = [], "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == sep:
            items.append(current)
            current = ""
            continue
        current += char
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def parse_strategy(item: str) -> tuple[str, str, str]:
    """``name[:overrides]`` -> (label, registered name, overrides); the name must be registered."""
    from strategies import REGISTRY

    name, _, overrides = item.partition(":")
    name = name.strip()
    if name not in REGISTRY:
        raise SystemExit(f"--strategies: '{name}' is not a registered strategy (registered: {', '.join(REGISTRY)})")
    return item.strip(), name, overrides.strip()


def parse_overrides(text: str, flag: str) -> dict[str, Any]:
    """``k=v k=v`` as ``flwr run --run-config`` reads it (SystemExit naming ``flag`` if it cannot)."""
    from flwr.common.config import parse_config_args

    try:
        return parse_config_args([text]) if text.strip() else {}
    except Exception as err:  # click's exception carries Flower's explanation of the format
        raise SystemExit(f"{flag}: cannot read {text!r}: {getattr(err, 'message', err)}") from None


def run_config(chosen: Preset, rounds: int, seed: int, name: str, overrides: str, extra: str, run_dir: Path) -> str:
    """The ``--run-config`` string of one run: the preset's values, then the common and the strategy's overrides
    (later ones win; Flower refuses a key given twice)."""
    values = {
        **chosen.overrides,
        "strategy": name,
        "seed": seed,
        "num-server-rounds": rounds,
        **parse_overrides(extra, "--run-config"),
        **parse_overrides(overrides, f"--strategies ({name})"),
        "run-dir": str(run_dir),
    }
    return " ".join(f"{k}={toml_value(v)}" for k, v in values.items())


def read_run(metrics_path: Path, label: str, seed: int) -> list[dict[str, Any]]:
    """The comparison rows of one finished run (one per client and round) from its metrics.jsonl."""
    rows = []
    seconds: dict[int, float] = {}
    clustering: dict[str, float] = {}
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row["node"] is None:
            seconds[row["round"]] = row["seconds"]
            clustering = clustering_scores(row) or clustering
        elif row.get("partition_id") is not None:
            rows.append(
                {
                    "strategy": label,
                    "seed": seed,
                    "client": row["partition_id"],
                    "round": row["round"],
                    "tasks": row.get("tasks"),
                    "model": row.get("model"),
                    **{k: row.get(k) for k in ROW_KEYS},
                }
            )
    for row in rows:
        row["seconds"] = seconds.get(row["round"])
        row.update(clustering)
    return rows


def clustering_scores(aggregate: dict[str, Any]) -> dict[str, float]:
    """A clustering strategy's purity and silhouette in one aggregate row (ATLAS: ``atlas.<family>``; whichever
    strategy reports per-family rows with a ``purity``), averaged over its model families; empty where none."""
    families = [
        row
        for entry in aggregate.values()
        if isinstance(entry, dict)
        for row in entry.values()
        if isinstance(row, dict) and row.get("purity") is not None and row.get("silhouette") is not None
    ]
    if not families:
        return {}
    return {key: sum(float(f[key]) for f in families) / len(families) for key in ("purity", "silhouette")}


def resolved_settings(config: str, pyproject: Path = PYPROJECT) -> dict[str, Any]:
    """Every value a run reads: pyproject.toml's app config with the run's ``--run-config`` on top, resolved by
    ``RunConfig`` and without the sections its strategy does not read (SimGrad's keys do not change a FedAvg run).

    Reuse compares these, not the override string: a run made before a default changed is not the same run.
    """
    from common.config import pyproject_defaults
    from strategies import load_run_config
    from strategies.registry import config_sections, strategy_spec

    defaults = pyproject_defaults(pyproject)
    cfg = load_run_config({**defaults, **parse_overrides(config, "run config")})
    unread = set(config_sections()) - {kind.key for kind in strategy_spec(cfg.strategy).sections(cfg)}
    where = {"run-dir", "resume"}  # where the run writes, not what it computes
    where |= {f"data.{key}" for key in cfg.data.unread()}  # what its data source does not read
    return {k: v for k, v in cfg.to_flat().items() if k.partition(".")[0] not in unread and k not in where}


def default_settings(pyproject: Path = PYPROJECT) -> dict[str, Any]:
    """Every key's default (pyproject.toml's app config resolved by ``RunConfig``), as the marker reads back."""
    from common.config import pyproject_defaults
    from strategies import load_run_config

    return json.loads(json.dumps(load_run_config(pyproject_defaults(pyproject)).to_flat()))


def same_settings(recorded: dict[str, Any], settings: dict[str, Any], defaults: dict[str, Any]) -> bool:
    """Whether a run recorded with ``recorded`` is the run ``settings`` asks for.

    A key the recorded run does not name was added to the config after it ran; it matches when this run leaves it
    at its default (a new key's default keeps the old behaviour, e.g. ``fraction-train=1.0``). Any other
    difference, a key removed since included, is a different run.
    """
    if set(recorded) - set(settings):
        return False
    return all(
        recorded[key] == value if key in recorded else key in defaults and value == defaults[key]
        for key, value in settings.items()
    )


def complete(run_dir: Path, settings: dict[str, Any], defaults: dict[str, Any]) -> bool:
    """Whether ``run_dir`` already holds this exact run (the same resolved settings, see ``same_settings``),
    finished."""
    marker, metrics = run_dir / "compare-run.json", run_dir / "metrics.jsonl"
    if not (marker.exists() and metrics.exists()):
        return False
    recorded = json.loads(marker.read_text())
    return recorded.get("ok", False) and same_settings(recorded.get("settings", {}), settings, defaults)


def set_aside(run_dir: Path) -> Path | None:
    """Move a finished run that is not the one asked for out of the way (``seed-N.superseded-K``), so that a rerun
    never writes over its metrics; None where ``run_dir`` holds no finished run."""
    if not (run_dir / "compare-run.json").exists():
        return None
    k = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.superseded-{k}")).exists():
        k += 1
    run_dir.rename(aside)
    return aside


def machine() -> dict[str, Any]:
    """What the comparison ran on (timings are only comparable on the same)."""
    model = platform.processor()
    flags = ""
    try:
        with open("/proc/cpuinfo") as handle:
            info = handle.read()
        model = re.search(r"model name\s*:\s*(.+)", info).group(1)  # type: ignore[union-attr]
        flags = re.search(r"flags\s*:\s*(.+)", info).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags.split(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


MERGE_KEYS = ("preset", "clients", "rounds", "common_config", "baseline")
VERDICT_REPLICATES = 2000  # bootstrap replicates per interval (bench.report.verdict_tables' default)


def run_machines(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The machine of every run of a report, keyed ``"label seed"`` (a merged report keeps its own map; an older
    one keyed by seed alone, or none, means that machine for every strategy)."""
    machines = report.get("machines", {})
    keys = {f"{r['strategy']} {r['seed']}": str(r["seed"]) for r in report["runs"]}
    return {key: machines.get(key, machines.get(seed, report["machine"])) for key, seed in keys.items()}


def merge_report(report: dict[str, Any], path: Path) -> dict[str, Any]:
    """Check that the earlier report at ``path`` compared the same thing (preset, budget, run config), with other
    seeds or other strategies; return what to add. Strategies paired later are paired on the seeds both ran.

    Raises SystemExit naming the first difference, or the strategies and seeds that ran in both.
    """
    earlier = json.loads(path.read_text())
    for key in MERGE_KEYS:
        if earlier.get(key) != report[key]:
            raise SystemExit(f"--merge {path}: {key} differs ({earlier.get(key)!r} there, {report[key]!r} here)")
    ran = {(r["strategy"], r["seed"]) for r in earlier["runs"]}
    if both := sorted(ran & {(s["label"], seed) for s in report["strategies"] for seed in report["seeds"]}):
        raise SystemExit(
            f"--merge {path}: {', '.join(f'{label} seed {seed}' for label, seed in both)} ran there too "
            "(run each strategy and seed once)"
        )
    return {
        "path": str(path),
        "seeds": earlier["seeds"],
        "strategies": earlier["strategies"],
        "machines": run_machines(earlier),
        "runs": earlier["runs"],
        "rows": earlier["rows"],
    }


def with_merged(report: dict[str, Any], merged: list[dict[str, Any]]) -> dict[str, Any]:
    """The report with the merged runs, rows and strategies added, and the machine of every strategy and seed."""
    machines = run_machines(report)
    strategies = list(report["strategies"])
    for m in merged:
        machines.update(m["machines"])
        strategies += [s for s in m["strategies"] if s not in strategies]
    return {
        **report,
        "strategies": strategies,
        "seeds": sorted({s for m in merged for s in m["seeds"]} | set(report["seeds"])),
        "machines": machines,
        "merged_from": [m["path"] for m in merged],
        "runs": [r for m in merged for r in m["runs"]] + report["runs"],
        "rows": [r for m in merged for r in m["rows"]] + report["rows"],
    }


def machine_line(report: dict[str, Any]) -> str:
    """Which machine ran which seeds (and strategies, where a seed's strategies ran on several), for the report."""
    labels = [s["label"] for s in report["strategies"]]
    by_machine: dict[str, dict[int, list[str]]] = {}
    for key, m in run_machines(report).items():
        label, seed = key.rsplit(" ", 1)
        name = f"{m['cpu']}, {m['cores']} cores, AVX512-BF16 {m['avx512_bf16']}, CUDA {m['cuda']}"
        by_machine.setdefault(name, {}).setdefault(int(seed), []).append(label)
    if len(by_machine) == 1:
        return f"Machine: {next(iter(by_machine))}."

    def what(per_seed: dict[int, list[str]]) -> str:
        if all(sorted(ran) == sorted(labels) for ran in per_seed.values()):
            return f"seeds {sorted(per_seed)}"
        by_strategies: dict[str, list[int]] = {}
        for seed, ran in sorted(per_seed.items()):
            by_strategies.setdefault(", ".join(ran), []).append(seed)
        return "; ".join(f"{ran} seeds {seeds}" for ran, seeds in by_strategies.items())

    return "Machines: " + "; ".join(f"{what(per_seed)} on {name}" for name, per_seed in by_machine.items()) + "."


def write_report(out: Path, report: dict[str, Any], merged: list[dict[str, Any]] | None = None) -> str:
    """``compare.json``, ``compare.md`` and ``compare.png`` from the collected rows (and any merged reports'); returns
    the verdict tables' markdown."""
    if merged:
        report = with_merged(report, merged)
    rows = report["rows"]
    labels = [s["label"] for s in report["strategies"]]
    baseline = report["baseline"] if report["baseline"] in labels else None
    walls = {(r["strategy"], r["seed"]): r["wall_seconds"] for r in report["runs"] if r.get("ok")}
    summaries = summarise(rows, baseline, walls)
    verdicts, report["verdicts"] = verdict_tables(rows, report.get("references", [report["baseline"]]))
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    failed = [f"{r['strategy']} seed {r['seed']}: {r['error']}" for r in report["runs"] if not r.get("ok")]
    text = [
        f"# Comparison: preset `{report['preset']}`",
        "",
        report["about"],
        "",
        f"Budget: {report['clients']} clients, {report['rounds']} rounds; seeds {report['seeds']}. Run config: "
        f"`{report['common_config']}`.",
        machine_line(report),
        "",
        "Final held-out loss (lower is better) and the rest, mean ± spread (sample std) over seeds; best per column "
        "in bold. 'worst vs local': worst-client loss minus the baseline's worst, same seed (< 0: better than "
        "training alone). 'clients hurt' / 'mean harm': clients whose loss is above their baseline loss, and by "
        f"how much. Baseline: `{report['baseline']}`.",
        "",
        markdown_table(summaries),
        "",
        "Paired differences (A − B < 0: A's loss is lower), per seed and averaged over seeds, with a bootstrap "
        "interval that resamples each client's held-out examples (the same resample for A and B; "
        f"{VERDICT_REPLICATES} replicates, seeded): 'better' / 'worse' when the interval excludes 0, else 'not "
        "resolved'. The interval covers evaluation noise; training noise shows in the per-seed values.",
        "",
        verdicts,
        "",
        "Per client (final held-out loss):",
        "",
        per_client_table(rows),
        "",
    ]
    if failed:
        text += ["Failed runs:", "", *[f"- {f}" for f in failed], ""]
    (out / "compare.md").write_text("\n".join(text))
    plot(rows, out / "compare.png")
    return verdicts


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: final loss per client by strategy (mean over seeds, spread as error bars). Right: worst-client loss per
    round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    from bench.report import client_metric, final_round, over_seeds, strategies_in

    strategies = strategies_in(rows)
    clients = sorted({r["client"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(strategies), 1)
    for i, strategy in enumerate(strategies):
        mine = [r for r in rows if r["strategy"] == strategy]
        seeds = sorted({r["seed"] for r in mine})
        finals = [
            client_metric(mine, strategy, s, final_round([r for r in mine if r["seed"] == s]), "eval_loss")
            for s in seeds
        ]
        stats = [over_seeds(f.get(c, float("nan")) for f in finals) for c in clients]
        left.bar(
            np.arange(len(clients)) + i * width,
            [s.mean for s in stats],
            width,
            yerr=[s.spread for s in stats],
            label=strategy,
        )
        by_round = worst_by_round(rows, strategy)
        rounds = sorted(by_round)
        right.errorbar(
            rounds, [by_round[r].mean for r in rounds], yerr=[by_round[r].spread for r in rounds], label=strategy
        )
    left.set_xticks(np.arange(len(clients)) + 0.4 - width / 2, [f"client {c}" for c in clients])
    left.set_ylabel("final held-out loss")
    left.set_title("per client")
    right.set_xlabel("round")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    right.set_ylabel("worst client's held-out loss")
    right.set_title("worst client per round")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="fedavg,simgrad,local")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--preset", default="tasks-distinct", choices=sorted(PRESETS))
    parser.add_argument("--clients", type=int, help="simulated clients (default: the preset's)")
    parser.add_argument("--rounds", type=int, help="server rounds (default: the preset's)")
    parser.add_argument("--run-config", default="", help="more run-config overrides for every run ('k=v k=v')")
    parser.add_argument("--out", default="runs/compare", help="the report directory")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds one run may take")
    parser.add_argument(
        "--client-cpus", type=int, help="CPUs per simulated client (Flower's default 2: one ClientApp actor on 2 cores)"
    )
    parser.add_argument("--baseline", default="local", help="the --strategies item negative transfer is against")
    parser.add_argument(
        "--references",
        default="local,fedavg",
        help="--strategies items every other strategy gets a paired verdict against (those not run are skipped)",
    )
    parser.add_argument(
        "--merge",
        action="append",
        default=[],
        help="an earlier compare.json whose runs (other seeds, or other strategies) join the report",
    )
    args = parser.parse_args(argv)

    from deploy.local_sim import flwr_run, prepare_home, stop_superlink

    # stopped from outside (kill, timeout): exit through the finally below, which stops the managed SuperLink, and
    # through subprocess.run, which kills the `flwr run` in flight; the default handler would leave both running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chosen = preset(args.preset)
    clients, rounds = args.clients or chosen.clients, args.rounds or chosen.rounds
    seeds = [int(s) for s in split_outside_quotes(args.seeds)]
    strategies = [parse_strategy(item) for item in split_outside_quotes(args.strategies)]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    home = prepare_home(out / "flwr-home")
    report: dict[str, Any] = {
        "preset": chosen.name,
        "about": chosen.about,
        "clients": clients,
        "rounds": rounds,
        "seeds": seeds,
        "baseline": args.baseline,
        "references": split_outside_quotes(args.references),
        "common_config": " ".join(f"{k}={toml_value(v)}" for k, v in chosen.overrides.items()) + f" {args.run_config}",
        "strategies": [{"label": label, "name": name, "overrides": extra} for label, name, extra in strategies],
        "machine": machine(),
        "runs": [],
        "rows": [],
    }
    merged = [merge_report(report, Path(path)) for path in args.merge]
    total = len(strategies) * len(seeds)
    defaults = default_settings()
    verdicts = ""
    try:
        # seed by seed: a comparison stopped early still has every strategy on the same seeds
        for i, (seed, (label, name, extra)) in enumerate(((seed, s) for seed in seeds for s in strategies), 1):
            run_dir = out / "runs" / re.sub(r"[^A-Za-z0-9_.=-]+", "_", label) / f"seed-{seed}"
            config = run_config(chosen, rounds, seed, name, extra, args.run_config, run_dir)
            run: dict[str, Any] = {"strategy": label, "seed": seed, "run_dir": str(run_dir), "run_config": config}
            settings = json.loads(json.dumps(resolved_settings(config)))  # as the marker reads back (lists, floats)
            marker = run_dir / "compare-run.json"
            if complete(run_dir, settings, defaults):
                run.update({k: v for k, v in json.loads(marker.read_text()).items() if k != "settings"}, reused=True)
            else:
                if aside := set_aside(run_dir):
                    print(f"[compare] {run_dir} ran with other settings: kept as {aside.name}", flush=True)
                started = time.perf_counter()
                proc = flwr_run(home, config, num_clients=clients, timeout=args.timeout, client_cpus=args.client_cpus)
                run["wall_seconds"] = time.perf_counter() - started
                why = run_problem(run_dir / "metrics.jsonl", rounds, clients)
                run["ok"] = proc.returncode == 0 and why is None
                run["error"] = None if run["ok"] else f"exit {proc.returncode}: {why}; log tail: {proc.stdout[-600:]}"
                if run["ok"]:
                    marker.write_text(
                        json.dumps(
                            {**{k: run[k] for k in ("run_config", "wall_seconds", "ok", "error")}, "settings": settings}
                        )
                    )
                (out / "logs").mkdir(exist_ok=True)
                (out / "logs" / f"{run_dir.parent.name}-seed-{seed}.log").write_text(proc.stdout + proc.stderr)
            rows = read_run(run_dir / "metrics.jsonl", label, seed) if run.get("ok") else []
            report["rows"] += rows
            report["runs"].append(run)
            print(progress_line(i, total, run, rows, rounds), flush=True)
            # after every run: a long comparison can be read while it goes on
            verdicts = write_report(out, report, merged)
    finally:
        stop_superlink(home)
    print(verdicts, flush=True)
    print(f"[compare] report: {out / 'compare.md'}", flush=True)
    return report


def run_problem(metrics_path: Path, rounds: int, clients: int) -> str | None:
    """Why a run that exited cannot be compared (None if it can): it must reach its last round with a held-out
    loss for every client at round 0 and at the end (an exit code of 0 alone proves nothing)."""
    if not metrics_path.exists():
        return "no metrics.jsonl"
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    for rnd in (0, rounds):
        losses = [r for r in rows if r["round"] == rnd and r["node"] is not None and r.get("eval_loss") is not None]
        if len(losses) < clients:
            errors = {str(r.get("eval_error")) for r in rows if r["round"] == rnd and r.get("eval_error")}
            return f"round {rnd}: {len(losses)} of {clients} clients have a held-out loss {sorted(errors)[:2]}"
    return None


def progress_line(i: int, total: int, run: dict[str, Any], rows: list[dict[str, Any]], rounds: int) -> str:
    head = f"[compare] {i}/{total} {run['strategy']} seed {run['seed']}:"
    if not run.get("ok"):
        return f"{head} FAILED ({(run.get('error') or '')[:200]})"
    final = [r["eval_loss"] for r in rows if r["round"] == rounds and r["eval_loss"] is not None]
    first = [r["eval_loss"] for r in rows if r["round"] == 0 and r["eval_loss"] is not None]
    how = "reused" if run.get("reused") else f"{run['wall_seconds']:.0f} s"
    return (
        f"{head} {how}; mean client loss {sum(first) / len(first):.3f} -> {sum(final) / len(final):.3f}, "
        f"worst {max(final):.3f}"
    )


if __name__ == "__main__":
    main()
