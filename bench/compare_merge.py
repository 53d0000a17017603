"""Joining comparisons (``bench.compare --merge``): an earlier report's runs of other seeds or other strategies, and
the machine every strategy and seed ran on (timings are only comparable on the same)."""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from bench.compare_runs import parse_overrides, same_settings
from bench.numeric_path import run_machines, with_paths

MERGE_KEYS = ("preset", "clients", "rounds", "common_config", "baseline", "split")
# what a report made before ``common.data.split`` (no "split" key) used: the seed shuffled the test split too
SPLIT_BEFORE = "by seed (made before the split by content: a seed's validation examples could be another's test ones)"


def split_rule(report: dict[str, Any]) -> str:
    """The rule that put a report's examples in their splits."""
    return report.get("split", SPLIT_BEFORE)


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


def machine_name(m: dict[str, Any]) -> str:
    """One line for a ``machine()`` record: what a timing table names as its machine."""
    return f"{m['cpu']}, {m['cores']} cores, AVX512-BF16 {m['avx512_bf16']}, CUDA {m['cuda']}"


def same_value(key: str, earlier: Any, here: Any) -> bool:
    """Whether a merge key agrees; run configs agree whatever the order of their keys."""
    if earlier == here:
        return True
    if key == "common_config" and isinstance(earlier, str):
        try:
            return parse_overrides(earlier, "--merge") == parse_overrides(here, "--merge")
        except SystemExit:  # a key given twice (a preset's and --run-config's) is compared as written
            return False
    return False


PER_RUN_KEYS = ("seed", "run-dir", "eval.initial")  # settings that differ between runs of one strategy


def without_per_run_keys(settings: dict[str, Any]) -> dict[str, Any]:
    """A strategy's settings without the keys that differ from run to run (``PER_RUN_KEYS``)."""
    return {k: v for k, v in settings.items() if k not in PER_RUN_KEYS}


def strategy_settings(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each strategy label's resolved settings, from the first of its runs that records them (older reports do
    not), without the keys that differ from run to run."""
    found: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run.get("settings") and run["strategy"] not in found:
            found[run["strategy"]] = without_per_run_keys(run["settings"])
    return found


def merge_report(
    report: dict[str, Any],
    path: Path,
    settings: dict[str, dict[str, Any]] | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Check that the earlier report at ``path`` compared the same thing (preset, budget, run config), with other
    seeds or other strategies; return what to add. Strategies paired later are paired on the seeds both ran.

    Raises SystemExit naming the first difference, or the strategies and seeds that ran in both.
    """
    earlier = json.loads(path.read_text())
    for key in MERGE_KEYS:
        there, here = (split_rule(r) if key == "split" else r.get(key) for r in (earlier, report))
        if not same_value(key, there, here):
            raise SystemExit(f"--merge {path}: {key} differs ({there!r} there, {here!r} here)")
    for label, there in strategy_settings(earlier["runs"]).items():  # one label, one strategy (not two defaults)
        here = without_per_run_keys((settings or {}).get(label, {}))
        if here and not same_settings(there, here, defaults or {}):
            keys = sorted(k for k in set(there) | set(here) if there.get(k) != here.get(k))
            raise SystemExit(f"--merge {path}: '{label}' ran with other settings there ({', '.join(keys[:5])})")
    ran = {(r["strategy"], r["seed"]) for r in earlier["runs"]}
    if both := sorted(ran & {(s["label"], seed) for s in report["strategies"] for seed in report["seeds"]}):
        raise SystemExit(
            f"--merge {path}: {', '.join(f'{label} seed {seed}' for label, seed in both)} ran there too "
            "(run each strategy and seed once)"
        )
    earlier = with_paths(earlier)  # every run and row names its numeric path (older reports: from their machine)
    return {
        "path": str(path),
        "seeds": earlier["seeds"],
        "strategies": earlier["strategies"],
        "machines": run_machines(earlier),
        "runs": earlier["runs"],
        "rows": earlier["rows"],
    }


def round_zero_rows(merged: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Round 0's rows of every seed in the merged reports, from the first strategy that has them: round 0 evaluates
    the base model (every adapter starts as the identity), the same for every strategy on a seed's clients, so a new
    run of that seed may borrow it (``borrows_round_zero``) instead of measuring it again."""
    found: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for m in merged:
        for row in m["rows"]:
            if row["round"] == 0:
                found.setdefault(row["seed"], {}).setdefault(row["strategy"], []).append(row)
    return {seed: next(iter(by_strategy.values())) for seed, by_strategy in found.items()}


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
        name = machine_name(m)
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
