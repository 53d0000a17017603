"""The comparison's verdicts: every strategy against the references, seed-aware, with the preset's primary claims
corrected for their number, over flat rows (one per strategy, seed, client and round; see ``bench.report``).

- **Primary claims** are declared by the preset before anything runs (``Preset.primary``: a statistic, by default
  the worst client's final loss, of every strategy that is not a reference against each reference, by default
  local-only and FedAvg). Their verdicts are seed-aware (``bench.stats.seed_aware_interval``: seeds and held-out
  examples resampled, with the paired t-test beside it) and Holm-corrected over the family.
- Everything else (the mean client, per-client differences) is **exploratory**: seed-aware, not corrected.
- The examples-only interval (seeds kept, only examples resampled) is shown beside each, labelled as such.
- A pair is only formed on seeds where both runs took the same numeric path (``bench.numeric_path``); the seeds
  refused are listed.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from bench.report import Row, client_labels, final_round, strategies_in
from bench.stats import MIN_SEEDS

PRIMARY_STATISTIC = "worst client"


def example_losses(
    rows: Sequence[Row], strategy: str, server_round: int | None = None
) -> dict[int, dict[int, tuple[list[float], list[int]]]]:
    """A strategy's per-example held-out losses and token counts at its final round (or ``server_round``): seed ->
    client -> (losses, tokens); runs without them (made before they were recorded) are left out."""
    out: dict[int, dict[int, tuple[list[float], list[int]]]] = {}
    mine = [r for r in rows if r["strategy"] == strategy]
    for seed in sorted({r["seed"] for r in mine}):
        run = [r for r in mine if r["seed"] == seed]
        last = final_round(run) if server_round is None else server_round
        clients = {
            r["client"]: (r["eval_example_loss"], r["eval_example_tokens"])
            for r in run
            if r["round"] == last and r.get("eval_example_loss") and r.get("eval_example_tokens")
        }
        if clients:
            out[seed] = clients
    return out


def final_paths(rows: Sequence[Row], strategy: str) -> dict[int, str | None]:
    """seed -> the numeric path of the strategy's final-round rows (None where rows do not say)."""
    mine = [r for r in rows if r["strategy"] == strategy]
    out: dict[int, str | None] = {}
    for seed in sorted({r["seed"] for r in mine}):
        run = [r for r in mine if r["seed"] == seed]
        last = final_round(run)
        out[seed] = next((r.get("path") for r in run if r["round"] == last), None)
    return out


def primary_pairs(strategies: Sequence[str], references: Sequence[str]) -> list[tuple[str, str]]:
    """The declared family: (A, reference) for every reference that ran and every strategy that is not one."""
    refs = [r for r in references if r in strategies]
    return [(a, r) for r in refs for a in strategies if a not in refs]


def all_pairs(strategies: Sequence[str], references: Sequence[str]) -> list[tuple[str, str]]:
    """Every strategy against every reference it is not, each unordered pair once."""
    done: set[frozenset[str]] = set()
    out = []
    for reference in [r for r in references if r in strategies]:
        for strategy in [s for s in strategies if s != reference]:
            if frozenset((strategy, reference)) not in done:
                done.add(frozenset((strategy, reference)))
                out.append((strategy, reference))
    return out


def interval_text(record: dict[str, Any]) -> str:
    """An interval record as every table and quoted verdict prints it: ``-0.014 [-0.022, -0.011]``."""
    return f"{record['estimate']:+.3f} [{record['low']:+.3f}, {record['high']:+.3f}]"


def interval_record(a: str, b: str, statistic: str, seed_aware: Any, examples: Any) -> dict[str, Any]:
    return {
        "a": a,
        "b": b,
        "statistic": statistic,
        "estimate": seed_aware.estimate,
        "low": seed_aware.low,
        "high": seed_aware.high,
        "per_seed": list(seed_aware.per_seed),
        "p": seed_aware.p_value,
        "t_p": seed_aware.t_p_value,
        "claim_p": seed_aware.claim_p,
        "verdict": seed_aware.verdict,
        "examples_low": examples.low,
        "examples_high": examples.high,
        "verdict_examples_only": examples.verdict,
        "level": seed_aware.level,
        "primary": False,
    }


def verdict_tables(
    rows: Sequence[Row],
    references: Sequence[str],
    primary: dict[str, Any] | None = None,
    replicates: int = 2000,
    level: float = 0.95,
    guarded: Collection[str] = (),
) -> tuple[str, list[dict]]:
    """Every strategy against every reference it is not (worst and mean client, per client), the preset's primary
    claims (``primary``: ``{"statistic", "references"}``; default the worst client against ``references``) Holm-
    corrected. ``guarded``: the labels that ran with the do-no-harm guard (``guarded_labels``), judged for it.
    Returns the markdown and the same as records (for compare.json)."""
    from bench.stats import (
        BETTER,
        STATISTICS,
        UNRESOLVED,
        WORSE,
        corrected_verdict,
        holm,
        paired_interval,
        per_client_intervals,
        seed_aware_interval,
    )

    primary = primary or {"statistic": PRIMARY_STATISTIC, "references": list(references)}
    strategies = strategies_in(rows)
    data = {s: example_losses(rows, s) for s in strategies}
    paths = {s: final_paths(rows, s) for s in strategies}
    labels = client_labels(rows)
    family = set(primary_pairs(strategies, primary["references"]))
    records: list[dict] = []
    refused: list[str] = []
    intervals: dict[tuple[str, str, str], Any] = {}
    ordered = primary_pairs(strategies, primary["references"])
    ordered += [p for p in all_pairs(strategies, references) if p not in family and p[::-1] not in family]
    for a, b in ordered:
        seeds = sorted(set(data[a]) & set(data[b]))
        mixed = [s for s in seeds if paths[a].get(s) != paths[b].get(s)]
        refused += [f"{a} − {b} seed {s}: {paths[a][s]} against {paths[b][s]}" for s in mixed]
        seeds = [s for s in seeds if s not in mixed]
        if not seeds:
            continue
        pa, pb = ({s: d[s] for s in seeds} for d in (data[a], data[b]))
        try:
            computed = {
                name: (
                    seed_aware_interval(pa, pb, statistic, replicates, level),
                    paired_interval(pa, pb, statistic, replicates, level),
                )
                for name, statistic in STATISTICS.items()
            }
            clients = per_client_intervals(pa, pb, replicates, level)
        except ValueError as err:  # e.g. the two runs evaluated different held-out examples: no pair, not a crash
            refused.append(f"{a} − {b}: {err}")
            continue
        for name, (aware, examples) in computed.items():
            intervals[(a, b, name)] = aware
            records.append(interval_record(a, b, name, aware, examples))
        records.append(
            {
                "a": a,
                "b": b,
                "statistic": "per client",
                "clients": {
                    str(c): {"estimate": i.estimate, "low": i.low, "high": i.high, "verdict": i.verdict}
                    for c, i in clients.items()
                },
            }
        )
    claims = [r for r in records if (r["a"], r["b"]) in family and r["statistic"] == primary["statistic"]]
    # a declared claim with no pair (refused on every seed) stays in the family, as a p-value of 1
    declared = [r["claim_p"] for r in claims] + [1.0] * (len(family) - len(claims))
    for record, adjusted in zip(claims, holm(declared)):
        interval = intervals[(record["a"], record["b"], record["statistic"])]
        record.update(primary=True, holm_p=adjusted, verdict=corrected_verdict(interval, adjusted))
    if not claims and not records:
        text = "No paired verdicts: no two strategies share seeds with per-example held-out losses."
        return text + "".join(f"\n- refused (numeric paths differ): {r}" for r in refused), records
    pct = f"{level:.0%}"
    head = (
        f"| A − B | statistic | per seed | mean over seeds [{pct}, seeds and examples resampled] | p (bootstrap / t) "
        f"| {{}}verdict | examples only [{pct}] |"
    )
    primary_lines = [head.format("Holm p | "), "|---|---|---|---|---|---|---|---|"]
    explore_lines = [head.format(""), "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["statistic"] == "per client":
            continue
        cells = [
            f"{r['a']} − {r['b']}",
            r["statistic"],
            ", ".join(f"{d:+.3f}" for d in r["per_seed"]),
            interval_text(r),
            f"{r['p']:.3g} / {'–' if r['t_p'] is None else format(r['t_p'], '.3g')}",
            *([f"{r['holm_p']:.3g}"] if r["primary"] else []),
            verdict_cell(r["verdict"])
            + ("" if len(r["per_seed"]) >= MIN_SEEDS else f" ({len(r['per_seed'])} seed(s))"),
            f"[{r['examples_low']:+.3f}, {r['examples_high']:+.3f}] {r['verdict_examples_only']}",
        ]
        (primary_lines if r["primary"] else explore_lines).append("| " + " | ".join(cells) + " |")
    harm = [
        "| A − B | clients better | clients worse | not resolved | worse (client: difference [interval]) |",
        "|---|---|---|---|---|",
    ]
    for r in (r for r in records if r["statistic"] == "per client"):
        verdicts = [c["verdict"] for c in r["clients"].values()]
        worse = "; ".join(
            f"{c} ({labels.get(int(c), '?')}): {interval_text(i)}"
            for c, i in r["clients"].items()
            if i["verdict"] == WORSE
        )
        harm.append(
            f"| {r['a']} − {r['b']} | {verdicts.count(BETTER)} | {verdicts.count(WORSE)} | "
            f"{verdicts.count(UNRESOLVED)} | {worse or '–'} |"
        )
    parts = [
        target_status(records, primary["references"], primary["statistic"], guarded),
        "",
        f"**Primary claims** (declared by the preset: {primary['statistic']} of every strategy against "
        f"{', '.join(primary['references'])}; Holm-corrected over these {len(family)}, family-wise {pct}):",
        "",
        *(primary_lines if claims else ["none (a reference or its per-example losses are missing)"]),
        "",
        "**Exploratory** (seed-aware, not corrected for their number: leads, not findings):",
        "",
        *explore_lines,
        "",
        "Who is helped or hurt (per client, averaged over seeds, seed-aware; exploratory):",
        "",
        *harm,
    ]
    if refused:
        parts += ["", "Refused pairs (the two runs took different numeric paths):", "", *[f"- {r}" for r in refused]]
    return "\n".join(parts), records


def target_status(
    records: Iterable[dict[str, Any]],
    references: Sequence[str] = ("local", "fedavg"),
    statistic: str = PRIMARY_STATISTIC,
    guarded: Collection[str] = (),
) -> str:
    """The evidence target, read off the verdict records: a strategy whose ``statistic`` (the preset's declared
    one: the worst client unless it names the mean client) is better than every reference's (its primary, corrected
    verdicts) with no client worse than under the first reference (local-only; per client, seed-aware). One
    sentence: who meets it, or why each candidate does not."""
    if not references:
        return "Target not judged: no reference strategy."
    records = list(records)
    by_pair = {(r["a"], r["b"], r["statistic"]): r for r in records}
    candidates = [a for a in dict.fromkeys(r["a"] for r in records) if a not in references]
    met, why = [], []
    for a in candidates:
        missing = []
        for ref in references:
            claim = by_pair.get((a, ref, statistic))
            if claim is None:
                missing.append(f"no pair with {ref}")
            elif claim["verdict"] != "better":
                adjusted = f", Holm p {claim['holm_p']:.2g}" if claim.get("holm_p") is not None else ""
                seeds = len(claim["per_seed"])
                adjusted += f", {seeds} seed{'s' if seeds > 1 else ''}" if seeds < MIN_SEEDS else ""
                missing.append(f"{statistic} − {ref} {claim['verdict']}{adjusted}")
        clients = client_records(by_pair, a, references[0]) or {}
        hurt = [c for c, v in clients.items() if v["verdict"] == "worse"]
        if hurt:
            missing.append(f"client{'s' if len(hurt) > 1 else ''} {', '.join(hurt)} worse than {references[0]}")
        if missing:
            why.append(f"{a}: {'; '.join(missing)}")
        else:
            met.append(a)
    if met:
        refs = " and ".join(references)
        harms = "; ".join(f"{a}: {largest_harm(by_pair, a, references[0])}" for a in met)
        status = (
            f"Target met by {', '.join(met)} ({statistic} better than {refs}, corrected; no client resolved worse "
            f"than {references[0]}; the interval reaching highest, per client: {harms})."
        )
    else:
        status = "Target not met" + (f" ({'; '.join(why)})." if why else ": no strategy to judge.")
    return status + do_no_harm_status(by_pair, [c for c in candidates if c in guarded or guard_label(c)], references[0])


def client_records(
    by_pair: dict[tuple[str, str, str], dict[str, Any]], a: str, reference: str
) -> dict[str, dict[str, Any]] | None:
    """``a``'s per-client interval records against ``reference`` (client -> record; None: no such pair)."""
    return by_pair.get((a, reference, "per client"), {}).get("clients")


def largest_harm(by_pair: dict[tuple[str, str, str], dict[str, Any]], a: str, reference: str) -> str:
    """The client of ``a`` whose seed-aware interval against ``reference`` reaches highest, as ``client 1 +0.000
    [-0.056, +0.076]``: "no client resolved worse" says nothing of how much harm an interval still allows."""
    clients = client_records(by_pair, a, reference)
    if not clients:
        return "no per-client intervals"
    client, record = max(clients.items(), key=lambda item: item[1]["high"])
    return f"client {client} {interval_text(record)}"


def guard_label(label: str) -> bool:
    """Whether a strategy label asks for the do-no-harm guard (``common.guard``) by name."""
    return bool(re.search(r"(^|[\s:])guard\.enabled=(true|1)\b", label, flags=re.IGNORECASE))


def guarded_labels(report: dict[str, Any]) -> set[str]:
    """The labels whose runs recorded the guard on (a run's resolved ``guard.enabled``,
    ``bench.compare_runs.resolved_settings``): by default SimGrad's, ATLAS's and MIRA's since 2026-12-03.
    ``target_status`` adds the labels that name it (``guard_label``), for reports older than recorded settings."""
    return {run["strategy"] for run in report.get("runs", []) if run.get("settings", {}).get("guard.enabled") is True}


def do_no_harm_status(by_pair: dict[tuple[str, str, str], dict[str, Any]], guarded: list[str], local: str) -> str:
    """The target's second half, for every strategy run with the guard (``guarded``): worse than ``local`` on no
    client (per client, seed-aware). Empty when no strategy ran with it."""
    lines = []
    for a in guarded:
        clients = client_records(by_pair, a, local)
        if clients is None:
            lines.append(f"{a}: no pair with {local}")
            continue
        seeds = len(by_pair.get((a, local, "worst client"), {}).get("per_seed", []))
        if seeds < MIN_SEEDS:  # no per-client verdict resolves on fewer seeds: "worse on no client" would be empty
            lines.append(f"{a}: not judged yet ({seeds} seed{'s' if seeds != 1 else ''}, {MIN_SEEDS} needed)")
            continue
        hurt = [c for c, v in clients.items() if v["verdict"] == "worse"]
        judged = (
            "worse on no client" if not hurt else f"worse on client{'s' if len(hurt) > 1 else ''} {', '.join(hurt)}"
        )
        lines.append(f"{a}: {judged} of {len(clients)}")
    return f" Do no harm (against {local}): {'; '.join(lines)}." if lines else ""


def verdict_cell(verdict: str) -> str:
    from bench.stats import UNRESOLVED

    return verdict if verdict == UNRESOLVED else f"**{verdict}**"
