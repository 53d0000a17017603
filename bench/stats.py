"""Paired bootstrap confidence intervals for comparing two strategies on the same clients and seeds.

Pure functions over NumPy arrays, tested without Flower. A run's verdict data are, per seed and client, the
held-out examples' mean loss per answer token and their token counts (``eval_example_loss`` /
``eval_example_tokens`` in the run's metrics). Two strategies run on the same seed evaluate the same held-out examples
of every client, in the same order, so the comparison is paired: every bootstrap replicate draws, for each seed and
client, one resample (with replacement) of that client's held-out examples and applies it to BOTH strategies. A
client's loss in a replicate is the token-weighted mean over its resampled examples (as ``eval_loss`` is over all).

The statistic is a difference per seed (e.g. worst client of A minus worst client of B), averaged over seeds; its
95 % interval is the percentile interval of the replicates. The interval covers the evaluation noise (which held-out
examples a client happens to have); the training noise enters through the seeds, whose differences are averaged and
also listed one by one. Verdict: ``better`` (A below B, interval below 0), ``worse`` (above 0) or ``not resolved``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

# seed -> client -> (per-example mean loss, per-example token count)
ExampleLosses = Mapping[int, Mapping[int, tuple[ArrayLike, ArrayLike]]]
Statistic = Callable[[np.ndarray], np.ndarray]  # (replicates, clients) client losses -> (replicates,)

BETTER, WORSE, UNRESOLVED = "better", "worse", "not resolved"


def worst_client(losses: np.ndarray) -> np.ndarray:
    """The highest client loss per replicate (rows: replicates, columns: clients)."""
    return losses.max(axis=-1)


def mean_client(losses: np.ndarray) -> np.ndarray:
    """The unweighted mean over clients per replicate (every client counts once, whatever its test size)."""
    return losses.mean(axis=-1)


STATISTICS: dict[str, Statistic] = {"worst client": worst_client, "mean client": mean_client}


@dataclass(frozen=True)
class Interval:
    """A paired difference A - B: its value on the data, the bootstrap interval, and the per-seed values."""

    estimate: float
    low: float
    high: float
    per_seed: tuple[float, ...]
    level: float = 0.95

    @property
    def verdict(self) -> str:
        if self.high < 0:
            return BETTER
        if self.low > 0:
            return WORSE
        return UNRESOLVED

    def __str__(self) -> str:
        return f"{self.estimate:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def client_loss(loss: ArrayLike, tokens: ArrayLike, index: np.ndarray | None = None) -> np.ndarray:
    """Token-weighted mean loss over the examples ``index`` picks (rows of resamples), or over all of them."""
    losses, counts = np.asarray(loss, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    if index is None:
        return np.asarray((losses * counts).sum() / max(counts.sum(), 1.0))
    return (losses * counts)[index].sum(axis=-1) / np.maximum(counts[index].sum(axis=-1), 1.0)


def _paired_clients(a: ExampleLosses, b: ExampleLosses) -> list[tuple[int, list[int]]]:
    """The seeds both runs have, each with the clients both have; the two must have evaluated the same examples."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("no seed in common: a paired comparison needs both strategies on the same seeds")
    paired = []
    for seed in seeds:
        clients = sorted(set(a[seed]) & set(b[seed]))
        if not clients:
            raise ValueError(f"seed {seed}: no client in common")
        for client in clients:
            tokens_a, tokens_b = np.asarray(a[seed][client][1]), np.asarray(b[seed][client][1])
            if tokens_a.shape != tokens_b.shape or not np.array_equal(tokens_a, tokens_b):
                raise ValueError(
                    f"seed {seed}, client {client}: the two runs evaluated different held-out examples "
                    f"({tokens_a.size} vs {tokens_b.size}, or other token counts); they cannot be paired"
                )
        paired.append((seed, clients))
    return paired


def paired_interval(
    a: ExampleLosses,
    b: ExampleLosses,
    statistic: Statistic,
    replicates: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """The paired difference statistic(A) - statistic(B), averaged over the seeds both have, with a percentile
    bootstrap interval that resamples held-out examples within each client and seed (the same resample for both)."""
    rng = np.random.default_rng(seed)
    per_seed, replicate_sum = [], np.zeros(replicates)
    for run_seed, clients in _paired_clients(a, b):
        observed = {name: np.zeros(len(clients)) for name in ("a", "b")}
        resampled = {name: np.zeros((replicates, len(clients))) for name in ("a", "b")}
        for column, client in enumerate(clients):
            n = np.asarray(a[run_seed][client][0]).size
            index = rng.integers(0, n, size=(replicates, n))
            for name, run in (("a", a), ("b", b)):
                loss, tokens = run[run_seed][client]
                observed[name][column] = client_loss(loss, tokens)
                resampled[name][:, column] = client_loss(loss, tokens, index)
        per_seed.append(float(statistic(observed["a"][None])[0] - statistic(observed["b"][None])[0]))
        replicate_sum += statistic(resampled["a"]) - statistic(resampled["b"])
    spread = replicate_sum / len(per_seed)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(spread, [tail, 100 - tail])
    return Interval(float(np.mean(per_seed)), float(low), float(high), tuple(per_seed), level)


def per_client_intervals(
    a: ExampleLosses, b: ExampleLosses, replicates: int = 2000, level: float = 0.95, seed: int = 0
) -> dict[int, Interval]:
    """For every client both have: its loss under A minus under B, averaged over the seeds, with the same paired
    bootstrap (who is helped or hurt, and whether by more than the evaluation noise)."""
    clients = sorted({c for s in set(a) & set(b) for c in set(a[s]) & set(b[s])})
    out = {}
    for client in clients:
        only = {
            name: {s: {client: run[s][client]} for s in run if client in run[s]} for name, run in (("a", a), ("b", b))
        }
        out[client] = paired_interval(only["a"], only["b"], mean_client, replicates, level, seed + client)
    return out
