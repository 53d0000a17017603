"""The comparison's report math, as pure functions over flat rows (one per strategy, seed, client and round).

A row: ``{"strategy", "seed", "client", "round", "eval_loss", "exact_match", "rouge_l", "bytes_up", "bytes_down",
"seconds"}`` (``seconds``: the round's wall time), optionally ``"peak_rss_mb"`` (of the process that served the client)
and ``"train_seconds"`` (its local training that round), and for a clustering strategy (ATLAS) the run's final
``"purity"`` and ``"silhouette"``. A strategy is compared on its final round; "negative transfer"
pairs each client with itself under the baseline (local-only training) and the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Row = dict


@dataclass(frozen=True)
class Spread:
    """A value over seeds: its mean and its spread (sample standard deviation; 0 for a single seed)."""

    mean: float
    spread: float
    n: int

    def __str__(self) -> str:
        return "n/a" if self.n == 0 else f"{self.mean:.3f} ± {self.spread:.3f}"


NO_VALUE = Spread(math.nan, math.nan, 0)


def over_seeds(values: Iterable[float]) -> Spread:
    """Mean and sample standard deviation of the per-seed values (NaNs are left out)."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not kept:
        return Spread(math.nan, math.nan, 0)
    mean = sum(kept) / len(kept)
    if len(kept) == 1:
        return Spread(mean, 0.0, 1)
    return Spread(mean, math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1)), len(kept))


def final_round(rows: Sequence[Row]) -> int:
    return max(r["round"] for r in rows)


def client_metric(rows: Sequence[Row], strategy: str, seed: int, server_round: int, key: str) -> dict[int, float]:
    """``key`` per client of one run at one round (clients without a value are left out)."""
    return {
        r["client"]: float(r[key])
        for r in rows
        if r["strategy"] == strategy and r["seed"] == seed and r["round"] == server_round and r.get(key) is not None
    }


def worst(values: dict[int, float]) -> float:
    """The worst client's loss (the highest)."""
    return max(values.values()) if values else math.nan


def negative_transfer(strategy_loss: dict[int, float], baseline_loss: dict[int, float]) -> dict[int, float]:
    """Per client present in both: strategy loss minus baseline loss (> 0: the strategy hurt that client)."""
    return {c: strategy_loss[c] - baseline_loss[c] for c in sorted(strategy_loss) if c in baseline_loss}


def hurt(transfer: dict[int, float]) -> tuple[int, float]:
    """How many clients a strategy hurt, and by how much on average (0 when it hurt none)."""
    harmed = [d for d in transfer.values() if d > 0]
    return len(harmed), (sum(harmed) / len(harmed) if harmed else 0.0)


@dataclass(frozen=True)
class StrategySummary:
    """One strategy's columns of the report, each over seeds."""

    strategy: str
    seeds: list[int]
    mean_loss: Spread
    worst_loss: Spread
    worst_vs_baseline: Spread  # worst-client loss minus the baseline's (same seed): < 0 beats it
    hurt_count: Spread
    hurt_size: Spread
    exact_match: Spread
    rouge_l: Spread
    bytes_up_per_round: Spread  # per client, averaged over training rounds
    bytes_down_per_round: Spread
    wall_seconds: Spread
    peak_rss_mb: Spread  # the largest client process's peak resident memory in the run
    train_seconds: Spread  # a client's local training per round, averaged over clients and rounds
    eval_seconds: Spread = NO_VALUE  # a client's evaluation per round, averaged over clients and rounds (0 included)
    purity: Spread = NO_VALUE  # a clustering strategy's final cluster-task purity
    silhouette: Spread = NO_VALUE  # ... and its clusters' silhouette


def strategies_in(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r["strategy"] for r in rows))


def summarise(
    rows: Sequence[Row], baseline: str | None, wall_seconds: dict[tuple[str, int], float] | None = None
) -> list[StrategySummary]:
    """Every strategy's summary; ``baseline`` names the local-only strategy (None: no transfer columns)."""
    out = []
    for strategy in strategies_in(rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        seeds = sorted({r["seed"] for r in mine})
        keys = (
            "mean",
            "worst",
            "gap",
            "count",
            "size",
            "em",
            "rl",
            "up",
            "down",
            "rss",
            "train",
            "eval",
            "purity",
            "silhouette",
        )
        per: dict[str, list[float]] = {k: [] for k in keys}
        for seed in seeds:
            run = [r for r in mine if r["seed"] == seed]
            last = final_round(run)
            loss = client_metric(run, strategy, seed, last, "eval_loss")
            per["mean"].append(sum(loss.values()) / len(loss) if loss else math.nan)
            per["worst"].append(worst(loss))
            for key, name in (("em", "exact_match"), ("rl", "rouge_l")):
                values = client_metric(run, strategy, seed, last, name)
                per[key].append(sum(values.values()) / len(values) if values else math.nan)
            trained = [r for r in run if r["round"] > 0]
            if trained:
                per["up"].append(sum(r["bytes_up"] for r in trained) / len(trained))
                per["down"].append(sum(r["bytes_down"] for r in trained) / len(trained))
                train = [r["train_seconds"] for r in trained if r.get("train_seconds") is not None]
                if train:
                    per["train"].append(sum(train) / len(train))
            evals = [r["eval_seconds"] for r in run if r.get("eval_seconds") is not None]
            if evals:  # every round, round 0 and the last (with eval.final-examples, the costly ones) included
                per["eval"].append(sum(evals) / len(evals))
            for key in ("purity", "silhouette"):  # one value per run, on every row
                per[key].append(next((r[key] for r in run if r.get(key) is not None), math.nan))
            rss = [r["peak_rss_mb"] for r in run if r.get("peak_rss_mb") is not None]
            if rss:
                per["rss"].append(max(rss))
            if baseline is not None and strategy != baseline:
                base_rows = [r for r in rows if r["strategy"] == baseline and r["seed"] == seed]
                if base_rows:
                    base = client_metric(base_rows, baseline, seed, final_round(base_rows), "eval_loss")
                    count, size = hurt(negative_transfer(loss, base))
                    per["count"].append(count)
                    per["size"].append(size)
                    per["gap"].append(worst(loss) - worst(base))
        walls = [wall_seconds[(strategy, s)] for s in seeds if wall_seconds and (strategy, s) in wall_seconds]
        out.append(
            StrategySummary(
                strategy,
                seeds,
                over_seeds(per["mean"]),
                over_seeds(per["worst"]),
                over_seeds(per["gap"]),
                over_seeds(per["count"]),
                over_seeds(per["size"]),
                over_seeds(per["em"]),
                over_seeds(per["rl"]),
                over_seeds(per["up"]),
                over_seeds(per["down"]),
                over_seeds(walls),
                over_seeds(per["rss"]),
                over_seeds(per["train"]),
                over_seeds(per["eval"]),
                over_seeds(per["purity"]),
                over_seeds(per["silhouette"]),
            )
        )
    return out


# (column title, attribute, format, lower is better)
COLUMNS = (
    ("mean client loss", "mean_loss", "{:.3f}", True),
    ("worst-client loss", "worst_loss", "{:.3f}", True),
    ("worst vs local", "worst_vs_baseline", "{:+.3f}", True),
    ("clients hurt", "hurt_count", "{:.1f}", True),
    ("mean harm", "hurt_size", "{:.3f}", True),
    ("EM", "exact_match", "{:.3f}", False),
    ("ROUGE-L", "rouge_l", "{:.3f}", False),
    ("KB up/client/round", "bytes_up_per_round", "{:.0f}", True),
    ("KB down", "bytes_down_per_round", "{:.0f}", True),
    ("wall s", "wall_seconds", "{:.0f}", True),
    ("train s/client/round", "train_seconds", "{:.1f}", True),
    ("eval s/client/round", "eval_seconds", "{:.1f}", True),
    ("peak RSS MB", "peak_rss_mb", "{:.0f}", True),
    ("purity", "purity", "{:.2f}", False),
    ("silhouette", "silhouette", "{:.2f}", False),
)


def best_by_column(summaries: Sequence[StrategySummary]) -> dict[str, str]:
    """Per column attribute, the strategy with the best mean (ties: the first); a column that only one strategy
    has (the transfer columns leave the baseline out) has no best."""
    best = {}
    for _, attr, _, lower in COLUMNS:
        scored = [(getattr(s, attr).mean, s.strategy) for s in summaries if getattr(s, attr).n]
        if len(scored) > 1:
            pick = min(scored, key=lambda t: t[0]) if lower else max(scored, key=lambda t: t[0])
            best[attr] = pick[1]
    return best


def markdown_table(summaries: Sequence[StrategySummary]) -> str:
    """The report table: mean ± spread over seeds per column, the best strategy per column in bold; a column no
    strategy has a value in (purity without a clustering strategy) is left out."""
    best = best_by_column(summaries)
    columns = [c for c in COLUMNS if any(getattr(s, c[1]).n for s in summaries)]
    lines = [
        "| strategy | seeds | " + " | ".join(title for title, *_ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for s in summaries:
        cells = []
        for _, attr, fmt, _ in columns:
            value: Spread = getattr(s, attr)
            if not value.n:
                cells.append("–")
                continue
            scale = 1 / 1024 if attr.startswith("bytes_") else 1.0
            text = f"{fmt.format(value.mean * scale)} ± {fmt.format(value.spread * scale).lstrip('+')}"
            cells.append(f"**{text}**" if best.get(attr) == s.strategy else text)
        lines.append(f"| {s.strategy} | {len(s.seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_client_table(rows: Sequence[Row]) -> str:
    """Final held-out loss per client (mean ± spread over seeds), strategies as rows; each client's column names its
    tasks and base model."""
    clients = sorted({r["client"] for r in rows})
    labels = client_labels(rows)
    header = " | ".join(f"client {c} ({labels[c]})" if labels.get(c) else f"client {c}" for c in clients)
    lines = [f"| strategy | {header} |", "|---|" + "---|" * len(clients)]
    for strategy in strategies_in(rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        finals = [
            client_metric(mine, strategy, seed, final_round([r for r in mine if r["seed"] == seed]), "eval_loss")
            for seed in sorted({r["seed"] for r in mine})
        ]
        cells = [str(over_seeds(f.get(c, math.nan) for f in finals)) for c in clients]
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def worst_by_round(rows: Sequence[Row], strategy: str) -> dict[int, Spread]:
    """The worst client's loss at every round, over seeds."""
    mine = [r for r in rows if r["strategy"] == strategy]
    seeds = sorted({r["seed"] for r in mine})
    rounds = sorted({r["round"] for r in mine})
    return {
        rnd: over_seeds(worst(client_metric(mine, strategy, seed, rnd, "eval_loss")) for seed in seeds)
        for rnd in rounds
    }


def gap_by_round(rows: Sequence[Row], strategy: str, baseline: str) -> dict[int, tuple[float, int, int]]:
    """``strategy`` against ``baseline`` at every round after round 0, on the clients and seeds both ran: round ->
    (mean of A − B over clients and seeds, how many of those were above the baseline, how many there were). It shows
    WHEN a strategy gains or loses, e.g. a gain made before the first exchange that later rounds give back."""
    out: dict[int, tuple[float, int, int]] = {}
    for rnd in sorted({r["round"] for r in rows if r["strategy"] == strategy and r["round"] > 0}):
        gaps = []
        for seed in sorted({r["seed"] for r in rows if r["strategy"] == strategy}):
            mine = client_metric(rows, strategy, seed, rnd, "eval_loss")
            base = client_metric(rows, baseline, seed, rnd, "eval_loss")
            gaps += [mine[c] - base[c] for c in mine if c in base]
        if gaps:
            out[rnd] = (sum(gaps) / len(gaps), sum(g > 0 for g in gaps), len(gaps))
    return out


def gap_by_round_table(rows: Sequence[Row], baseline: str) -> str:
    """Markdown: every strategy minus ``baseline``, round by round (``gap_by_round``); empty without a baseline."""
    names = [s for s in strategies_in(rows) if s != baseline]
    gaps = {s: gap_by_round(rows, s, baseline) for s in names}
    rounds = sorted({rnd for g in gaps.values() for rnd in g})
    if baseline not in strategies_in(rows) or not rounds:
        return ""
    lines = [f"| A − {baseline} | " + " | ".join(f"round {rnd}" for rnd in rounds) + " |"]
    lines.append("|---|" + "---|" * len(rounds))
    for name in names:
        cells = [f"{gaps[name][r][0]:+.3f} ({gaps[name][r][1]}/{gaps[name][r][2]} above)" if r in gaps[name] else "–"
                 for r in rounds]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def client_labels(rows: Sequence[Row]) -> dict[int, str]:
    """Each client's tasks and base model, as a reader needs them to see who is helped or hurt."""
    labels: dict[int, str] = {}
    for r in rows:
        tasks = r.get("tasks")
        tasks = ",".join(tasks) if isinstance(tasks, list) else tasks
        model = str(r.get("model") or "").split("/")[-1]
        labels.setdefault(r["client"], ", ".join(str(part) for part in (tasks, model) if part))
    return labels
