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
import re
import signal
import sys
from pathlib import Path
from typing import Any

from bench.compare_merge import machine, machine_line, merge_report, round_zero_rows, split_rule, with_merged
from bench.compare_plot import plot
from bench.compare_runs import (
    borrows_round_zero,
    default_settings,
    one_run,
    read_run,
    resolved_settings,
    run_config,
)
from bench.numeric_path import lendable, numeric_path, with_paths
from bench.presets import PRESETS, preset, toml_value
from bench.report import gap_by_round_table, markdown_table, per_client_table, summarise
from bench.verdicts import guarded_labels, verdict_tables
from common.data.split import SPLIT_RULE
from common.section import ConfigError


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


VERDICT_REPLICATES = 2000  # bootstrap replicates per interval (bench.verdicts.verdict_tables' default)


def write_report(out: Path, report: dict[str, Any], merged: list[dict[str, Any]] | None = None) -> str:
    """``compare.json``, ``compare.md`` and ``compare.png`` from the collected rows (and any merged reports'); returns
    the verdict tables' markdown."""
    if merged:
        report = with_merged(report, merged)
    report = with_paths(report)  # runs and rows without a recorded numeric path: from their machine and settings
    rows = report["rows"]
    labels = [s["label"] for s in report["strategies"]]
    baseline = report["baseline"] if report["baseline"] in labels else None
    # a run that borrowed round 0 is charged what round 0 cost its lender: every wall is a whole run's
    walls = {
        (r["strategy"], r["seed"]): r["wall_seconds"] + (r.get("initial_seconds") or 0.0)
        for r in report["runs"]
        if r.get("ok")
    }
    borrowed = sorted({(r["seed"], r["initial_from"]) for r in report["runs"] if r.get("initial_from")})
    summaries = summarise(rows, baseline, walls)
    references = report.get("references", [report["baseline"]])
    verdicts, report["verdicts"] = verdict_tables(
        rows, references, report.get("primary"), guarded=guarded_labels(report)
    )
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
        f"Numeric path: {'; '.join(sorted({str(r.get('path')) for r in report['runs']}))} (pairs only on one).",
        f"Split: {split_rule(report)}.",
        "",
        *(
            [
                "Round 0 (the base model: every adapter starts as the identity) was evaluated once per seed and "
                "shared by the other strategies of that seed ("
                + ", ".join(f"seed {seed}: {lender}" for seed, lender in borrowed)
                + "); their wall times include what it cost.",
                "",
            ]
            if borrowed
            else []
        ),
        "Final held-out loss (lower is better) and the rest, mean ± spread (sample std) over seeds; best per column "
        "in bold. 'worst vs local': worst-client loss minus the baseline's worst, same seed (< 0: better than "
        "training alone). 'clients hurt' / 'mean harm': clients whose loss is above their baseline loss, and by "
        f"how much. Baseline: `{report['baseline']}`.",
        "",
        markdown_table(summaries),
        "",
        "Paired differences (A − B < 0: A's loss is lower), per seed and averaged over seeds. The verdict's "
        "interval is seed-aware: a hierarchical bootstrap that draws seeds with replacement, then resamples each "
        "client's held-out examples within every drawn seed (the same resample for A and B; "
        f"{VERDICT_REPLICATES} replicates, seeded); 'better' / 'worse' needs that interval to exclude 0 AND the "
        "paired t-test over the per-seed differences to agree (p < 0.05), with at least 3 seeds; primary claims "
        "also need their Holm-adjusted p-value below 0.05. 'examples only' keeps the seeds and resamples only "
        "held-out examples: it leaves out seed-to-seed variation and is shown for reference.",
        "",
        verdicts,
        "",
        *(
            [
                f"Against `{report['baseline']}`, round by round: A − B of every client's held-out loss, averaged over "
                "clients and seeds, and how many (client, seed) pairs ended the round above the baseline (the rounds "
                "between the first and the last read fewer examples: the curves, not verdicts).",
                "",
                by_round,
                "",
            ]
            if (by_round := gap_by_round_table(rows, report["baseline"]))
            else []
        ),
        "Per client (final held-out loss):",
        "",
        per_client_table(rows),
        "",
    ]
    if failed:
        text += ["Failed runs:", "", *[f"- {f}" for f in failed], ""]
    (out / "compare.md").write_text("\n".join(text))
    plot(rows, out / "compare.png")  # bench.compare_plot
    return verdicts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=_HelpFormatter,
        epilog="Runs: strategies x seeds (15 with the defaults), one after another, each a whole `flwr run` of the "
        "preset (minutes to tens of minutes on 2 cores: see the stored reports' wall times in docs/results/); each "
        "run's start, its end and an estimate of the time left are printed, and the report is rewritten after every "
        "run.",
    )
    parser.add_argument("--strategies", default="fedavg,simgrad,local", help="comma-separated items (see above)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (3+ for seed-aware verdicts)")
    parser.add_argument("--preset", default="tasks-distinct", choices=sorted(PRESETS), help="the scenario")
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
    parser.add_argument(
        "--rerender",
        action="store_true",
        help="run nothing: rewrite --out's compare.md and verdicts from its compare.json with the current statistics "
        "(the verdicts it held are kept once, as verdicts_before)",
    )
    args = parser.parse_args(argv)
    if args.rerender:
        return rerender(Path(args.out))

    from deploy.local_sim import prepare_home, stop_superlink

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
        "split": SPLIT_RULE,  # which examples are test, validation and training (the same for every run of it)
        "primary": chosen.primary,  # the claims declared before running, corrected for their number
        "runs": [],
        "rows": [],
    }
    defaults = default_settings()
    # each label's settings, so that a merge never puts two different strategies (e.g. two defaults) under one label
    settings = {}
    for label, name, extra in strategies:  # every configuration checked before the first run starts
        try:
            settings[label] = resolved_settings(run_config(chosen, rounds, seeds[0], name, extra, args.run_config, out))
        except ConfigError as err:
            raise SystemExit(f"[compare] {label}: {err}\n[compare] nothing was run") from None
    merged = [merge_report(report, Path(path), settings, defaults) for path in args.merge]
    total = len(strategies) * len(seeds)
    verdicts = ""
    try:
        # seed by seed: a comparison stopped early still has every strategy on the same seeds
        # seed -> round 0's rows: a merged report's, else measured by the seed's first run here
        lenders: dict[int, list[dict[str, Any]]] = round_zero_rows(merged)
        for i, (seed, (label, name, extra)) in enumerate(((seed, s) for seed in seeds for s in strategies), 1):
            run_dir = out / "runs" / re.sub(r"[^A-Za-z0-9_.=-]+", "_", label) / f"seed-{seed}"
            configs = [run_config(chosen, rounds, seed, name, extra, args.run_config, run_dir)]
            path = numeric_path({"settings": resolved_settings(configs[0])}, report["machine"])
            if seed in lenders and not lendable(lenders[seed], path):
                print(
                    f"[compare] seed {seed}: round 0 of {lenders[seed][0]['strategy']} ran on another numeric path "
                    f"({lenders[seed][0].get('path')}; here: {path}): not borrowed, measured again",
                    flush=True,
                )
                del lenders[seed]
            if seed in lenders and borrows_round_zero(extra):
                configs.append(
                    run_config(chosen, rounds, seed, name, f"{extra} eval.initial=false", args.run_config, run_dir)
                )
            print(start_line(i, total, label, seed, report["runs"]), flush=True)
            run = {
                "strategy": label,
                "seed": seed,
                **one_run(run_dir, configs, defaults, home, clients, rounds, args, out, path),
            }
            run["path"] = run.get("path") or path  # a reused run made before paths were recorded: this machine's
            rows = read_run(run_dir / "metrics.jsonl", label, seed) if run.get("ok") else []
            rows = [{**r, "path": run["path"]} for r in rows]
            if run.get("ok") and not any(r["round"] == 0 for r in rows):  # it borrowed round 0 (on its own path)
                rows = [{**r, "strategy": label} for r in lenders[seed]] + rows
                run["initial_from"] = lenders[seed][0]["strategy"]
                run["initial_seconds"] = lenders[seed][0]["seconds"]
            elif seed not in lenders and borrows_round_zero(extra) and any(r["round"] == 0 for r in rows):
                # only a run whose overrides leave round 0 as every run of the seed has it may lend it
                lenders[seed] = [r for r in rows if r["round"] == 0]
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


def rerender(out: Path) -> dict[str, Any]:
    """Rewrite a stored report's verdicts and compare.md from its compare.json (runs, rows, machines) alone."""
    report = json.loads((out / "compare.json").read_text())
    old_style = [v for v in report.get("verdicts", []) if v["statistic"] != "per client" and "claim_p" not in v]
    if old_style and "verdicts_before" not in report:  # made before the seed-aware verdicts: keep what it said
        report["verdicts_before"] = report["verdicts"]
    if "primary" not in report and report["preset"] in PRESETS:  # made before presets declared their claims
        report["primary"] = PRESETS[report["preset"]].primary
    print(write_report(out, report), flush=True)
    return report


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, "", []) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def start_line(i: int, total: int, label: str, seed: int, done: list[dict[str, Any]]) -> str:
    """What is starting, and the time the rest will take at the pace of the runs made so far (reused ones left out)."""
    head = f"[compare] {i}/{total} {label} seed {seed}: starting"
    walls = [r["wall_seconds"] for r in done if r.get("ok") and not r.get("reused") and r.get("wall_seconds")]
    if not walls:
        return f"{head} (no run timed yet)"
    pace = sum(walls) / len(walls)
    return f"{head}; about {pace / 60:.0f} min a run so far, about {pace * (total - i + 1) / 60:.0f} min left"


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


def exit_code(report: dict[str, Any]) -> int:
    """1 when a run of the comparison failed (each failure is printed as it happens, with the run's reason)."""
    failed = [f"{r['strategy']} seed {r['seed']}" for r in report.get("runs", []) if not r.get("ok")]
    if failed:
        print(f"[compare] {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(exit_code(main()))
