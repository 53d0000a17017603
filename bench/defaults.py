"""Choose a strategy's default on more than one structure: the validation split of several presets, one rule.

    python -m bench.defaults --strategy atlas --key atlas.min-cluster-size --values 1,2 --seeds 0 --out DIR

A default chosen on one preset fits that preset's structure: ``atlas.min-cluster-size=2``, chosen on
``few-shot-pairs`` (every task has a partner), put the two partner-less clients of another structure in one cluster
and cost them both. So every candidate value runs on every preset of ``--presets`` (default ``CHECKED_ON``: one
where every task has a partner, one with partner-less clients, one of keyword categories), beside local-only, on the
VALIDATION split (``data.eval-split='validation'``: the test split the verdicts are made on is not looked at), and
the value is picked by a rule fixed here before anything runs:

1. **Harm first**: the value whose largest worst-client difference against local-only, over the presets (averaged
   over seeds), is smallest: a default must not cost the clients of any one structure.
2. Values within ``TIE`` of that: the lowest mean-client difference, averaged over the presets.

Each preset's runs are one ``bench.compare`` report under ``DIR/<preset>/`` (finished runs are reused); ``DIR``
gets ``defaults.json`` and ``defaults.md`` (per preset and value: worst- and mean-client difference against
local-only, clients worse, and the choice with its reason).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.compare import split_outside_quotes
from bench.report import Row, client_metric, final_round

CHECKED_ON = ("few-shot-pairs", "few-shot-partnerless", "ni-categories")
TIE = 0.005  # worst-client differences this close count as equal (well inside one seed's evaluation noise)
VALIDATION = "data.eval-split='validation'"


@dataclass(frozen=True)
class Against:
    """One candidate on one preset against local-only (final round, validation split, means over seeds)."""

    worst: float  # worst client's loss minus local-only's worst client's
    mean: float  # mean client's loss minus local-only's
    clients_worse: float  # clients whose loss is above their local-only loss (mean over seeds)
    seeds: int


def against_local(rows: Sequence[Row], label: str, local: str = "local") -> Against | None:
    """``label``'s final-round client losses against ``local``'s, seed by seed (None: no seed both ran)."""
    worst, mean, worse = [], [], []
    for seed in sorted({r["seed"] for r in rows if r["strategy"] == label}):
        mine = [r for r in rows if r["seed"] == seed and r["strategy"] in (label, local)]
        last = final_round(mine)
        a = client_metric(mine, label, seed, last, "eval_loss")
        b = client_metric(mine, local, seed, last, "eval_loss")
        if not a or set(a) != set(b):
            continue
        worst.append(max(a.values()) - max(b.values()))
        mean.append(sum(a.values()) / len(a) - sum(b.values()) / len(b))
        worse.append(sum(a[c] > b[c] for c in a))
    if not worst:
        return None
    n = len(worst)
    return Against(sum(worst) / n, sum(mean) / n, sum(worse) / n, n)


def choose_default(table: dict[str, dict[str, Against | None]]) -> tuple[str, str]:
    """value -> preset -> its record: the chosen value and the reason, by the rule in the module docstring. A
    value missing on some preset cannot be chosen (it was not checked there)."""
    checked = {v: by for v, by in table.items() if by and all(r is not None for r in by.values())}
    if not checked:
        raise ValueError("no value ran on every preset beside local-only")
    harm = {v: max(r.worst for r in by.values() if r is not None) for v, by in checked.items()}
    least = min(harm.values())
    tied = [v for v in checked if harm[v] <= least + TIE]
    mean = {v: sum(r.mean for r in checked[v].values() if r is not None) / len(checked[v]) for v in tied}
    chosen = min(tied, key=lambda v: mean[v])
    reason = f"largest worst-client difference against local-only over the presets {harm[chosen]:+.3f}"
    if len(tied) > 1:
        others = ", ".join(f"{v} {mean[v]:+.3f}" for v in tied if v != chosen)
        reason += f"; tied within {TIE}, the lowest mean client ({mean[chosen]:+.3f}, against {others})"
    return chosen, reason


def candidate_label(strategy: str, fixed: str, key: str | None, value: str) -> str:
    """The ``bench.compare`` label of one candidate: ``key=value`` on top of the fixed overrides, or (no key) the
    value as a whole set of overrides, ``defaults`` being the strategy with none."""
    overrides = " ".join(o for o in (fixed, f"{key}={value}" if key else "" if value == "defaults" else value) if o)
    return f"{strategy}:{overrides}" if overrides else strategy


def cell(record: Against | None) -> str:
    return "–" if record is None else f"{record.worst:+.3f} / {record.mean:+.3f} / {record.clients_worse:g}"


def markdown(
    key: str | None, strategy: str, table: dict[str, dict[str, Against | None]], chosen: str, reason: str
) -> str:
    presets = list(dict.fromkeys(p for by in table.values() for p in by))
    lines = [
        f"# {f'`{key}`' if key else 'Settings'} for `{strategy}`, checked on {', '.join(f'`{p}`' for p in presets)}",
        "",
        "Validation split (the test split was not looked at); differences against local-only at the final round, "
        "means over seeds (lower is better): worst client / mean client / clients worse.",
        "",
        "| value | " + " | ".join(presets) + " |",
        "|---|" + "---|" * len(presets),
    ]
    for value, by in table.items():
        cells = [cell(by.get(p)) for p in presets]
        lines.append(f"| {value} | " + " | ".join(cells) + " |")
    lines += ["", f"Chosen: **{f'{key}={chosen}' if key else chosen}** ({reason})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", required=True, help="a registered strategy (with fixed overrides: 'name:k=v')")
    parser.add_argument(
        "--key",
        help="the run-config key to choose, e.g. atlas.min-cluster-size; without it each value is a whole "
        "set of overrides ('k=v k=v'), and 'defaults' is the strategy as it is",
    )
    parser.add_argument("--values", required=True, help="the candidate values, comma-separated")
    parser.add_argument("--presets", default=",".join(CHECKED_ON))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", default="runs/defaults")
    parser.add_argument("--client-cpus", type=int)
    args = parser.parse_args(argv)
    from bench import compare

    name, _, fixed = args.strategy.partition(":")
    values = split_outside_quotes(args.values)
    labels = {v: candidate_label(name, fixed, args.key, v) for v in values}
    out = Path(args.out)
    table: dict[str, dict[str, Against | None]] = {v: {} for v in values}
    for preset in split_outside_quotes(args.presets):
        command = ["--preset", preset, "--strategies", ",".join(["local", *labels.values()]), "--seeds", args.seeds]
        command += ["--run-config", VALIDATION, "--out", str(out / preset), "--references", "local"]
        if args.client_cpus:
            command += ["--client-cpus", str(args.client_cpus)]
        rows = compare.main(command)["rows"]
        for value, label in labels.items():
            table[value][preset] = against_local(rows, label)
    chosen, reason = choose_default(table)
    result = {
        "strategy": args.strategy,
        "key": args.key,
        "rule": "least largest worst-client difference against local-only over the presets; ties by mean client",
        "tie": TIE,
        "table": {v: {p: (asdict(r) if r else None) for p, r in by.items()} for v, by in table.items()},
        "chosen": chosen,
        "reason": reason,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "defaults.json").write_text(json.dumps(result, indent=1))
    (out / "defaults.md").write_text(markdown(args.key, args.strategy, table, chosen, reason))
    print(f"[defaults] {f'{args.key}={chosen}' if args.key else chosen}: {reason}")
    return result


if __name__ == "__main__":
    main()
