"""The numeric path a comparison run's numbers came from, and the rule that pairs only runs on the same one.

Two machines can compute different losses for the same model and data: on a CPU with AVX512-BF16, NF4 evaluation
may run bitsandbytes' packed bf16 kernel (``model.cpu-packed-inference``), elsewhere it runs in fp32; a GPU computes
in bf16. Round 0 of the same base model differed by up to 0.068 per client between the two kinds of CPU, as large
as the effects a comparison looks for. So every run records its path, and a paired verdict, or a round 0 lent from
one run to another, only joins runs on the same path. The presets evaluate in fp32 on every CPU (one path).
"""

from __future__ import annotations

from typing import Any

CPU_FP32 = "cpu, nf4, eval in fp32"
CPU_PACKED_BF16 = "cpu, nf4, eval in bf16 (packed kernel, AVX512-BF16)"


def setting(run: dict[str, Any], key: str, default: Any) -> Any:
    """A run's resolved setting, from its recorded settings or (older reports) its run-config string."""
    settings = run.get("settings") or {}
    if key in settings:
        return settings[key]
    for item in str(run.get("run_config", "")).split():
        name, _, value = item.partition("=")
        if name == key:
            return {"true": True, "false": False}.get(value, value.strip("'\""))
    return default


def numeric_path(run: dict[str, Any], machine: dict[str, Any]) -> str:
    """The path of one run (its record: settings or run config) on ``machine`` (``compare_merge.machine()``)."""
    quantization = setting(run, "model.quantization", "nf4")
    if machine.get("cuda") and setting(run, "model.device", "auto") != "cpu":
        return f"cuda ({machine['cuda']}), {quantization}, bf16 compute"
    if quantization != "nf4":
        return f"cpu, {quantization}"
    packed = bool(setting(run, "model.cpu-packed-inference", True)) and bool(machine.get("avx512_bf16"))
    return CPU_PACKED_BF16 if packed else CPU_FP32


def run_machines(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The machine of every run of a report, keyed ``"label seed"`` (a merged report keeps its own map; an older
    one keyed by seed alone, or none, means that machine for every strategy)."""
    machines = report.get("machines", {})
    keys = {f"{r['strategy']} {r['seed']}": str(r["seed"]) for r in report["runs"]}
    return {key: machines.get(key, machines.get(seed, report["machine"])) for key, seed in keys.items()}


def run_paths(report: dict[str, Any]) -> dict[tuple[str, int], str]:
    """Every run's path, keyed (label, seed): as recorded, else from the run's machine and settings."""
    machines = run_machines(report)
    return {
        (r["strategy"], r["seed"]): r.get("path") or numeric_path(r, machines[f"{r['strategy']} {r['seed']}"])
        for r in report["runs"]
    }


def with_paths(report: dict[str, Any]) -> dict[str, Any]:
    """The report with every run and row carrying its path (a row lent as round 0 keeps its lender's)."""
    paths = run_paths(report)
    lenders = {(r["strategy"], r["seed"]): r.get("initial_from") for r in report["runs"]}

    def row_path(row: dict[str, Any]) -> str | None:
        lender = lenders.get((row["strategy"], row["seed"])) if row["round"] == 0 else None
        return row.get("path") or paths.get((lender or row["strategy"], row["seed"]))

    runs = [{**r, "path": paths[(r["strategy"], r["seed"])]} for r in report["runs"]]
    return {**report, "runs": runs, "rows": [{**row, "path": row_path(row)} for row in report["rows"]]}


def lendable(round_zero: list[dict[str, Any]], path: str) -> bool:
    """Whether round 0's rows (a seed's base-model evaluation) may stand in for a run on ``path``: only when they
    were measured on the same path."""
    return bool(round_zero) and all(row.get("path") == path for row in round_zero)
