"""One run of a comparison (``bench.compare``): its run config, whether a finished run can be reused (the resolved
settings, not the override string), running it through ``flwr run . local``, and reading its rows back.

Round 0 evaluates the base model (every adapter starts as the identity), so it is the same for every strategy on the
same clients and seed: a comparison measures it once per seed and the other runs borrow it (``eval.initial=false``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.presets import Preset, toml_value

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
    Returned as the run's marker reads them back (JSON lists and floats), so that they compare with recorded ones.
    """
    from common.config import pyproject_defaults
    from strategies import load_run_config
    from strategies.registry import config_sections, strategy_spec

    defaults = pyproject_defaults(pyproject)
    cfg = load_run_config({**defaults, **parse_overrides(config, "run config")})
    unread = set(config_sections()) - {kind.key for kind in strategy_spec(cfg.strategy).sections(cfg)}
    where = {"run-dir", "resume"}  # where the run writes, not what it computes
    where |= {f"data.{key}" for key in cfg.data.unread()}  # what its data source does not read
    kept = {k: v for k, v in cfg.to_flat().items() if k.partition(".")[0] not in unread and k not in where}
    kept["guard.enabled"] = cfg.guarded  # what 'auto' came to for this strategy and split
    return read_guard(json.loads(json.dumps(kept)))


def read_guard(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's settings with the guard's keys only where the guard ran (``guard.enabled`` true): an unguarded run
    reads none of them, so a run recorded before one of their defaults changed is the same run."""
    if settings.get("guard.enabled") is not False:
        return settings
    return {k: v for k, v in settings.items() if not k.startswith("guard.") or k == "guard.enabled"}


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
    recorded, settings = read_guard(recorded), read_guard(settings)
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


def borrows_round_zero(overrides: str) -> bool:
    """Whether a strategy with these overrides may take round 0's evaluation from another run of its seed: round 0
    evaluates the base model (every adapter starts as the identity), so only the data, evaluation, model and seed
    settings change it (not ``model.overrides``: the keys it may set, step sizes and a gate's start, leave every
    adapter at the identity)."""
    keys = parse_overrides(overrides, "--strategies")
    return not any(
        k == "seed" or (k.split(".")[0] in ("data", "eval", "model") and k != "model.overrides") for k in keys
    )


def one_run(
    run_dir: Path,
    configs: list[str],
    defaults: dict[str, Any],
    home: Path,
    clients: int,
    rounds: int,
    args: argparse.Namespace,
    out: Path,
    path: str | None = None,
) -> dict[str, Any]:
    """Reuse the first of ``configs`` that ``run_dir`` already holds complete, else run the last one; the run's
    record (config, resolved settings, wall seconds, ok, error, reused, and the numeric ``path`` it ran on: a reused
    run keeps the one it recorded)."""
    from deploy.local_sim import flwr_run

    for config in configs:
        settings = resolved_settings(config)
        marker = run_dir / "compare-run.json"
        if complete(run_dir, settings, defaults):
            return {"run_dir": str(run_dir), **json.loads(marker.read_text()), "reused": True}
    if aside := set_aside(run_dir):
        print(f"[compare] {run_dir} ran with other settings: kept as {aside.name}", flush=True)
    run: dict[str, Any] = {"run_dir": str(run_dir), "run_config": config, "settings": settings, "path": path}
    started = time.perf_counter()
    proc = flwr_run(home, config, num_clients=clients, timeout=args.timeout, client_cpus=args.client_cpus)
    run["wall_seconds"] = time.perf_counter() - started
    why = run_problem(run_dir / "metrics.jsonl", rounds, clients, initial=bool(settings["eval.initial"]))
    run["ok"] = proc.returncode == 0 and why is None
    run["error"] = None if run["ok"] else f"exit {proc.returncode}: {why}; log tail: {proc.stdout[-600:]}"
    if run["ok"]:
        record = {k: run[k] for k in ("run_config", "wall_seconds", "ok", "error", "path")}
        marker.write_text(json.dumps({**record, "settings": settings}))
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / f"{run_dir.parent.name}-{run_dir.name}.log").write_text(proc.stdout + proc.stderr)
    return run


def run_problem(metrics_path: Path, rounds: int, clients: int, initial: bool = True) -> str | None:
    """Why a run that exited cannot be compared (None if it can): it must reach its last round with a held-out
    loss for every client at round 0 (``initial``: unless it borrowed it) and at the end (an exit code of 0 alone
    proves nothing)."""
    if not metrics_path.exists():
        return "no metrics.jsonl"
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    for rnd in (0, rounds) if initial else (rounds,):
        losses = [r for r in rows if r["round"] == rnd and r["node"] is not None and r.get("eval_loss") is not None]
        if len(losses) < clients:
            errors = {str(r.get("eval_error")) for r in rows if r["round"] == rnd and r.get("eval_error")}
            return f"round {rnd}: {len(losses)} of {clients} clients have a held-out loss {sorted(errors)[:2]}"
    return None
