"""What record-level DP-SGD costs, as a table: every configuration of a comparison at each record-level epsilon.

    python -m bench.record_dp_table REPORT_DIR [REPORT_DIR ...] [--out DIR] [--doc docs/privacy.md]

Reads the comparisons' ``compare.json`` (``bench.compare``; its strategies named ``base`` and
``base:dp.record-epsilon=E``, e.g. ``fedavg-dual:dp.record-epsilon=8``) and answers, per configuration and epsilon:
does every client still learn (its held-out loss after the last round below round 0's, resolved seed-aware), and how
far is it from the same configuration without DP (mean client, seed-aware interval)? The epsilon each member spent
and its noise come from the runs' ``metrics.jsonl`` beside the report (kept in ``record-dp.json`` so that a stored
report re-renders without them). Writes ``record-dp.md`` and ``record-dp.json`` to ``--out`` (default: the first
report's directory) and, with ``--doc``, the table between the page's ``<!-- record-dp-table -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.compare_runs import parse_overrides
from bench.report import Row, over_seeds
from bench.stats import BETTER, mean_client, per_client_intervals, seed_aware_interval
from bench.verdicts import example_losses

EPSILON_KEY = "dp.record-epsilon"
BEGIN, END = "<!-- record-dp-table -->", "<!-- /record-dp-table -->"


def split_label(label: str) -> tuple[str, float | None]:
    """A strategy label as (configuration, record-level epsilon or None): ``fedavg:dp.record-epsilon=8 secure=true``
    -> (``fedavg:secure=true``, 8.0)."""
    name, _, extra = label.partition(":")
    epsilon = parse_overrides(extra, "--strategies").get(EPSILON_KEY) if extra.strip() else None
    rest = [t for t in shlex.split(extra, posix=False) if not t.startswith(f"{EPSILON_KEY}=")]
    return (f"{name}:{' '.join(rest)}" if rest else name), None if epsilon is None else float(epsilon)


def client_losses(rows: Sequence[Row], strategy: str, server_round: int) -> dict[int, dict[int, float]]:
    """seed -> client -> held-out loss at ``server_round``."""
    out: dict[int, dict[int, float]] = {}
    for r in rows:
        if r["strategy"] == strategy and r["round"] == server_round and r.get("eval_loss") is not None:
            out.setdefault(r["seed"], {})[r["client"]] = float(r["eval_loss"])
    return out


SPENT_KEYS = ("dp_record_epsilon", "dp_record_noise_multiplier", "dp_record_sampling_rate")


def _run_dirs(report_dir: Path, report: dict[str, Any], label: str) -> dict[str, Path]:
    """seed -> the run directory of ``label`` that seed ran in: the report's own ``runs/`` and, for runs a report
    merged from another comparison (``bench.compare --merge``), the directory each run names."""
    folder = report_dir / "runs" / re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)
    dirs = {path.name.removeprefix("seed-"): path for path in sorted(folder.glob("seed-*"))}
    for run in report.get("runs", []):
        if run.get("strategy") == label and run.get("run_dir"):
            dirs.setdefault(str(run["seed"]), Path(run["run_dir"]))
    return dirs


def privacy_spent(
    report_dir: Path, report: dict[str, Any], stored_files: Sequence[Path] = ()
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """label -> seed -> the last round's ``dp_record_epsilon`` / ``_noise_multiplier`` / ``_sampling_rate`` of
    every member, from the runs' metrics; a seed whose run directory is gone keeps what a stored ``record-dp.json``
    holds for it (the report's own, then ``stored_files``: a stored report re-renders without its runs)."""
    stored: dict[str, Any] = {}
    for path in [*stored_files, report_dir / "record-dp.json"]:  # the report's own wins
        if path.exists():
            stored.update(json.loads(path.read_text()).get("spent", {}))
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for label in (s["label"] for s in report["strategies"]):
        kept = stored.get(label, {})
        if kept and all(isinstance(v, list) for v in kept.values()):  # written before seeds were told apart
            kept = {"stored": kept}
        by_seed = {seed: dict(values) for seed, values in kept.items()}
        for seed, run_dir in _run_dirs(report_dir, report, label).items():
            metrics = run_dir / "metrics.jsonl"
            if not metrics.exists():
                continue
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            last = max((r["round"] for r in rows), default=0)
            found = [r for r in rows if r["round"] == last and r.get("dp_record_epsilon") is not None]
            if found:
                by_seed[seed] = {key: [float(r[key]) for r in found] for key in SPENT_KEYS}
        if by_seed:
            out[label] = by_seed
    return out


def table_rows(report: dict[str, Any], spent: dict[str, dict[str, dict[str, list[float]]]]) -> list[dict[str, Any]]:
    """One record per strategy of the report: its configuration, epsilon, losses and verdicts (see the module)."""
    rows: list[Row] = report["rows"]
    labels = [s["label"] for s in report["strategies"]]
    last = max(r["round"] for r in rows)
    plain = {split_label(label)[0]: label for label in labels if split_label(label)[1] is None}
    out = []
    for label in labels:
        base, epsilon = split_label(label)
        final, start = example_losses(rows, label), example_losses(rows, label, 0)
        learned = per_client_intervals(final, start) if final and start else {}
        record: dict[str, Any] = {
            "strategy": label,
            "configuration": base,
            "epsilon": epsilon,
            "seeds": len(final),
            "mean_client": _spread(client_losses(rows, label, last), np.mean),
            "worst_client": _spread(client_losses(rows, label, last), np.max),
            "round_0_mean_client": _spread(client_losses(rows, label, 0), np.mean),
            "clients": len(learned),
            "clients_learned": sum(i.verdict == BETTER for i in learned.values()),
            "least_learned": str(max(learned.values(), key=lambda i: i.estimate)) if learned else None,
        }
        reference = plain.get(base)
        if epsilon is not None and reference is not None and final:
            interval = seed_aware_interval(final, example_losses(rows, reference), mean_client)
            record["vs_no_dp"], record["vs_no_dp_verdict"] = str(interval), interval.verdict
        alone = _local_label(label, labels)
        if alone is not None and final:  # what sharing adds (or costs) at the same budget
            interval = seed_aware_interval(final, example_losses(rows, alone), mean_client)
            record["vs_local"], record["vs_local_verdict"] = str(interval), interval.verdict
        for key in SPENT_KEYS:
            values = [v for by_key in spent.get(label, {}).values() for v in by_key.get(key, [])]
            if values:
                record[key] = [min(values), max(values)]
        out.append(record)
    return out


def _local_label(label: str, labels: Sequence[str]) -> str | None:
    """The local-only run at ``label``'s record-level epsilon (``local`` for no DP), when the report has it and
    ``label`` is not local-only itself."""
    base, epsilon = split_label(label)
    if base.partition(":")[0] == "local":
        return None
    matches = [x for x in labels if split_label(x) == ("local", epsilon)]
    return matches[0] if matches else None


def _spread(by_seed: dict[int, dict[int, float]], statistic) -> str:
    values = [float(statistic(list(clients.values()))) for clients in by_seed.values() if clients]
    return str(over_seeds(values)) if values else "–"


def markdown(records: Sequence[dict[str, Any]], command: str) -> str:
    """The table, with the command that made it."""
    head = (
        "| configuration | record-level epsilon | seeds | mean client loss (round 0 -> last) | worst client | "
        "clients learned (resolved) | least learning client: last - round 0 [95%] | mean client - same without DP "
        "[95%] | mean client - local-only at the same epsilon [95%] | z (noise multiplier) | epsilon spent |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(records, key=lambda r: (r["configuration"], -(r["epsilon"] or 1e9))):
        epsilon = "none" if r["epsilon"] is None else f"{r['epsilon']:g}"
        vs = f"{r['vs_no_dp']} {r['vs_no_dp_verdict']}" if "vs_no_dp" in r else "–"
        alone = f"{r['vs_local']} {r['vs_local_verdict']}" if "vs_local" in r else "–"
        z, spent = r.get("dp_record_noise_multiplier"), r.get("dp_record_epsilon")
        noise = f"{z[0]:.3f}-{z[1]:.3f}" if z else "–"
        used = f"{spent[0]:.2f}-{spent[1]:.2f}" if spent else "–"
        lines.append(
            f"| `{r['configuration']}` | {epsilon} | {r['seeds']} | {r['round_0_mean_client']} -> {r['mean_client']} "
            f"| {r['worst_client']} | {r['clients_learned']} of {r['clients']} | {r['least_learned'] or '–'} | {vs} "
            f"| {alone} "
            f"| {noise} | {used} |"
        )
    return f"```bash\n{command}\n```\n\n" + head + "\n".join(lines) + "\n"


def write_into(doc: Path, table: str) -> None:
    """Replace what lies between the page's markers with ``table`` (ValueError if the page has no markers)."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc}: no {BEGIN} ... {END} markers to write the table between")
    before, rest = text.split(BEGIN, 1)
    doc.write_text(f"{before}{BEGIN}\n{table}{END}{rest.split(END, 1)[1]}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="comparison directories (each with its compare.json)")
    parser.add_argument("--out", help="where record-dp.md and record-dp.json go (default: the first report's)")
    parser.add_argument("--doc", help="a page with record-dp-table markers to write the table into")
    parser.add_argument("--command", default="", help="the command that made the comparisons (shown above the table)")
    args = parser.parse_args(argv)
    records, spent_all = [], {}
    out = Path(args.out or args.reports[0])
    for folder in map(Path, args.reports):
        report = json.loads((folder / "compare.json").read_text())
        spent = privacy_spent(folder, report, [out / "record-dp.json"])
        spent_all.update(spent)
        records += table_rows(report, spent)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(records, args.command or f"python -m bench.record_dp_table {' '.join(args.reports)}")
    (out / "record-dp.md").write_text(table)
    (out / "record-dp.json").write_text(json.dumps({"spent": spent_all, "table": records}, indent=1) + "\n")
    if args.doc:
        write_into(Path(args.doc), table)
    print(table, flush=True)
    return records


if __name__ == "__main__":
    main()
