"""How much each primary claim of a stored report rests on any one seed: the claim recomputed with each seed left out.

    python -m bench.robustness docs/results/<report>

A verdict that needs every one of its seeds is weaker than one that survives the loss of any: "better after Holm
with five seeds, not resolved with seed 0 left out" is what a reader should know before relying on it. For every
primary claim (the preset's declared family), the whole family is recomputed on the report's rows without one seed
(every seed in turn: the same seed-aware bootstrap, the same Holm correction over the same family), and the claim's
Holm p-value and verdict are kept. The result is stored in the report's ``compare.json`` under ``robustness`` (a
``bench.tables robustness`` marker renders it), and printed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.compare_merge import with_paths
from bench.report import Row
from bench.stats import MIN_SEEDS
from bench.verdicts import verdict_tables


def leave_one_seed_out(
    rows: Sequence[Row], primary: dict[str, Any], claims: Sequence[dict[str, Any]], replicates: int = 2000
) -> list[dict[str, Any]]:
    """For each primary claim record (``a``, ``b``, ``statistic``, ``holm_p``, ``verdict``, ``per_seed``), its Holm
    p-value and verdict with each of its seeds left out, the family recomputed from ``rows`` each time. A claim with
    fewer than ``MIN_SEEDS`` + 1 seeds has no leave-one-out that could resolve and gets none."""
    seeds = sorted({r["seed"] for r in rows})
    without: dict[int, dict[tuple[str, str], dict[str, Any]]] = {}
    for seed in seeds if len(seeds) > MIN_SEEDS else []:
        _, records = verdict_tables([r for r in rows if r["seed"] != seed], primary["references"], primary, replicates)
        without[seed] = {(r["a"], r["b"]): r for r in records if r.get("primary")}
    ran = {(r["strategy"], r["seed"]) for r in rows}
    out = []
    for claim in claims:
        # only the claim's own seeds (both strategies ran them), and none where leaving one leaves too few to resolve
        own = [s for s in without if (claim["a"], s) in ran and (claim["b"], s) in ran]
        left = {
            str(seed): {"holm_p": got["holm_p"], "verdict": got["verdict"]}
            for seed in (own if len(own) > MIN_SEEDS else [])
            if (got := without[seed].get((claim["a"], claim["b"]))) is not None
        }
        out.append(
            {
                "a": claim["a"],
                "b": claim["b"],
                "statistic": claim["statistic"],
                "holm_p": claim["holm_p"],
                "verdict": claim["verdict"],
                "seeds": len(claim["per_seed"]),
                "without": left,
            }
        )
    return out


def stands(record: dict[str, Any]) -> bool | None:
    """Whether a claim keeps its verdict with any one seed left out (None: no leave-one-out was possible)."""
    if not record["without"]:
        return None
    return all(w["verdict"] == record["verdict"] for w in record["without"].values())


def robustness_table(records: Sequence[dict[str, Any]]) -> list[str]:
    """The markdown lines: per claim, its verdict and Holm p on all seeds, the range of its Holm p with one seed
    left out and the seeds whose absence changes the verdict."""
    lines = [
        "| A − B | statistic | seeds | verdict (all seeds) | Holm p | Holm p, one seed left out | verdict changes "
        "without seed | stands |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ps = [w["holm_p"] for w in r["without"].values()]
        changed = [s for s, w in r["without"].items() if w["verdict"] != r["verdict"]]
        span = f"{min(ps):.2g}-{max(ps):.2g}" if ps else "–"
        verdict = {True: "yes", False: "**no**", None: "–"}[stands(r)]
        lines.append(
            f"| {r['a']} − {r['b']} | {r['statistic']} | {r['seeds']} | {r['verdict']} | {r['holm_p']:.2g} | {span} "
            f"| {', '.join(changed) or '–'} | {verdict} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="a stored report's directory (its compare.json)")
    args = parser.parse_args(argv)
    path = args.report / "compare.json"
    report = json.loads(path.read_text())
    if "primary" not in report or not report.get("verdicts"):
        raise SystemExit(f"{path}: no primary claims (made before presets declared them; --rerender it first)")
    claims = [v for v in report["verdicts"] if v.get("primary")]
    report["robustness"] = leave_one_seed_out(with_paths(report)["rows"], report["primary"], claims)
    path.write_text(json.dumps(report, indent=1))
    print("\n".join(robustness_table(report["robustness"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
