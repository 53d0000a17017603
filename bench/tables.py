"""The results tables of the README and the docs, generated from the stored reports (no hand-typed result numbers).

A page asks for a table with a marker, and this fills (or, with ``--check``, checks) the lines up to the closing one:

    <!-- bench.tables primary docs/results/<report>/compare.json -->
    ...generated...
    <!-- /bench.tables -->

Kinds: ``primary`` (a report's verdicts against the references: the preset's primary claims with their Holm-adjusted
p-values, the rest marked exploratory), ``before-after`` (a report made before the seed-aware verdicts: each
verdict it resolved then, beside what the current statistics say of the same runs) and ``robustness`` (each primary
claim with one seed left out, as ``bench.robustness`` stored it in the report). Report paths are relative to the
repository root.

    python -m bench.tables            # rewrite every marked table in README.md and docs/
    python -m bench.tables --check    # exit 1 naming every table that differs from its report

Both also name every verdict quoted in prose (an interval, a Holm p) that no stored report holds
(``bench.prose_numbers``); ``--check`` fails on them too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from bench.prose_numbers import unsupported
from bench.robustness import robustness_table
from bench.stats import MIN_SEEDS
from bench.verdicts import PRIMARY_STATISTIC, client_records, guarded_labels, interval_text, target_status

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- bench\.tables (?P<kind>[a-z-]+) (?P<report>\S+) -->$")
END = "<!-- /bench.tables -->"


def pages(root: Path | None = None) -> list[Path]:
    root = root or ROOT
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def verdict_text(record: dict[str, Any]) -> str:
    verdict = record["verdict"]
    shown = verdict if verdict == "not resolved" else f"**{verdict}**"
    seeds = len(record.get("per_seed", ()))
    return shown + ("" if seeds >= MIN_SEEDS else f" ({seeds} seed{'s' if seeds > 1 else ''})")


def primary_references(report: dict[str, Any]) -> list[str]:
    """The references a report's claims were made against: its declared primary, else (older reports) its
    ``references``, as ``bench.verdicts.verdict_tables`` reads them."""
    return (report.get("primary") or {}).get("references") or report.get("references") or ["local", "fedavg"]


def primary_statistic(report: dict[str, Any]) -> str:
    """The statistic a report's preset declared its claims on (older reports: the worst client)."""
    return (report.get("primary") or {}).get("statistic", PRIMARY_STATISTIC)


def records_by_pair(verdicts: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(v["a"], v["b"], v["statistic"]): v for v in verdicts}


def heading(report: dict[str, Any], link: str) -> str:
    paths = sorted({r.get("path") or "not recorded" for r in report["runs"] if r.get("ok", True)})
    split = report.get("split", "by seed (made before the split by content)")
    seeds = sorted({r["seed"] for r in report["runs"] if r.get("ok", True)})
    return (
        f"`{report['preset']}`: {report['clients']} clients, {report['rounds']} rounds; seeds run: "
        f"{', '.join(map(str, seeds))}; numeric path: {'; '.join(paths)}; split: {split}; "
        f"[report]({link})."
    )


def primary_table(report: dict[str, Any], link: str) -> str:
    """Every pair on the statistic the preset declared primary (``Preset.primary``: the worst client, or the mean
    client; primary claims with their Holm p, the rest exploratory), the other statistic beside it (exploratory)
    and the per-client counts."""
    by_pair = records_by_pair(report.get("verdicts", []))
    references = primary_references(report)
    declared = primary_statistic(report)
    beside = "mean client" if declared == "worst client" else "worst client"
    lines = [
        heading(report, link),
        "",
        target_status(report.get("verdicts", []), references, declared, guarded_labels(report)),
        "",
        f"| A − B | {declared}, per seed | {declared} [95 %, seed-aware] | p (bootstrap / t) | Holm p | verdict "
        f"| {beside} [95 %] (exploratory) | clients better / worse |",
        "|---|---|---|---|---|---|---|---|",
    ]
    headline = [v for v in report.get("verdicts", []) if v["statistic"] == declared]
    for record in sorted(headline, key=lambda v: not v.get("primary")):
        other = by_pair.get((record["a"], record["b"], beside))
        clients = client_records(by_pair, record["a"], record["b"]) or {}
        counts = [c["verdict"] for c in clients.values()]
        t_p = "–" if record.get("t_p") is None else f"{record['t_p']:.2g}"
        cells = [
            f"{record['a']} − {record['b']}",
            ", ".join(f"{d:+.3f}" for d in record["per_seed"]),
            interval_text(record),
            f"{record['p']:.2g} / {t_p}",
            f"{record['holm_p']:.2g}" if record.get("primary") else "– (exploratory)",
            verdict_text(record),
            f"{interval_text(other)} {verdict_text(other)}" if other else "–",
            f"{counts.count('better')} / {counts.count('worse')}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def before_after_table(report: dict[str, Any], link: str) -> str:
    """Every verdict a report resolved before the seed-aware statistics, and the same claim now."""
    now = records_by_pair(report.get("verdicts", []))
    before = [
        v
        for v in report.get("verdicts_before", [])
        if v["statistic"] in ("worst client", "mean client") and v.get("verdict") in ("better", "worse")
    ]
    lines = [
        heading(report, link),
        "",
        "| A − B | statistic | then: examples only, every seed | now: seed-aware, one numeric path | now | survives |",
        "|---|---|---|---|---|---|",
    ]
    kept = 0
    for old in before:
        new = now.get((old["a"], old["b"], old["statistic"]))
        if new is None:
            now_cells = ["no pair (numeric paths differ on every seed)", "–"]
            survives = False
        else:
            seeds = f"{len(new['per_seed'])} seeds"
            label = "primary" if new.get("primary") else "exploratory"
            now_cells = [f"{interval_text(new)}, {seeds}", f"{new['verdict']} ({label})"]
            survives = new["verdict"] == old["verdict"]
        kept += survives
        lines.append(
            f"| {old['a']} − {old['b']} | {old['statistic']} | {interval_text(old)} {old['verdict']} | "
            + " | ".join(now_cells)
            + f" | {'yes' if survives else '**no**'} |"
        )
    references = primary_references(report)
    lines += [
        "",
        f"{kept} of {len(before)} verdicts resolved then still stand. Now: "
        + target_status(now.values(), references, primary_statistic(report), guarded_labels(report)),
    ]
    return "\n".join(lines)


def robustness(report: dict[str, Any], link: str) -> str:
    """Each primary claim with one seed left out (``bench.robustness``, stored in the report); refused where the
    report's claims have changed since it was computed (a re-render with other runs)."""
    stored = report.get("robustness")
    if stored is None:
        raise SystemExit(f"{link}: no robustness stored (python -m bench.robustness {Path(link).parent})")
    now = {(v["a"], v["b"]): v for v in report.get("verdicts", []) if v.get("primary")}
    for r in stored:
        claim = now.get((r["a"], r["b"]))
        if claim is None or (claim["holm_p"], claim["verdict"]) != (r["holm_p"], r["verdict"]):
            raise SystemExit(f"{link}: its robustness is older than its claims (python -m bench.robustness)")
    return "\n".join([heading(report, link), "", *robustness_table(stored)])


RENDER = {"primary": primary_table, "before-after": before_after_table, "robustness": robustness}


def render_page(page: Path, root: Path | None = None) -> str:
    """The page with every marked table generated from its report (report paths relative to ``root``)."""
    root = root or ROOT
    out: list[str] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        out.append(lines[i])
        match = MARKER.match(lines[i].strip())
        i += 1
        if not match:
            continue
        if match["kind"] not in RENDER:
            raise SystemExit(f"{page}: unknown table kind {match['kind']!r} (have {', '.join(RENDER)})")
        try:
            end = next(j for j in range(i, len(lines)) if lines[j].strip() == END)
        except StopIteration:
            raise SystemExit(f"{page}: a bench.tables marker without its {END}") from None
        report_path = root / match["report"]
        report = json.loads(report_path.read_text())
        link = os.path.relpath(report_path.parent / "compare.md", page.parent)
        out += ["", RENDER[match["kind"]](report, link), "", END]
        i = end + 1
    return "\n".join(out) + "\n"


def stale_pages(root: Path | None = None) -> list[Path]:
    """The pages whose marked tables differ from what their reports generate."""
    root = root or ROOT
    return [page for page in pages(root) if page.exists() and render_page(page, root) != page.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    args = parser.parse_args(argv)
    quoted = unsupported(pages(), ROOT / "docs" / "results", ROOT)
    for finding in quoted:
        print(f"{finding}: a number in prose that no stored report holds (bench.prose_numbers)")
    if args.check:
        stale = stale_pages()
        for page in stale:
            print(f"{page.relative_to(ROOT)}: a results table differs from its report (python -m bench.tables)")
        return 1 if stale or quoted else 0
    for page in pages():
        text = render_page(page)
        if text != page.read_text():
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
