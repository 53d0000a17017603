"""Paired bootstrap intervals, tests and a multiplicity correction for comparing two strategies on the same clients
and seeds.

Pure functions over NumPy arrays, tested without Flower. A run's verdict data are, per seed and client, the
held-out examples' mean loss per answer token and their token counts (``eval_example_loss`` /
``eval_example_tokens`` in the run's metrics). Two strategies run on the same seed evaluate the same held-out examples
of every client, in the same order, so the comparison is paired: a resample of a client's held-out examples is applied
to BOTH strategies. A client's loss in a replicate is the token-weighted mean over its resampled examples (as
``eval_loss`` is over all).

The statistic is a difference per seed (e.g. worst client of A minus worst client of B), averaged over seeds. Two
intervals of it:

- **seed-aware** (``seed_aware_interval``, what verdicts are made on): a hierarchical bootstrap. Each replicate draws
  the seeds with replacement, then for every drawn seed an independent resample of every client's held-out examples,
  so the interval holds seed-to-seed variation (training, initialisation, few-shot draw) as well as evaluation noise:
  seeds that disagree give a wide interval however many examples they have. Beside it, a paired t-test over the
  per-seed differences (``paired_t``); a seed-aware verdict needs both (the bootstrap alone, drawing from the few
  seeds seen, is too sure: of 40 simulated comparisons with no true effect and 5 seeds, it called 6, with the t-test
  beside it 2, the examples-only interval 38; ``tests/test_stats.py``).
  With fewer than ``MIN_SEEDS`` seeds the seed variation cannot be estimated and the verdict is "not resolved".
- **examples only** (``paired_interval``): the seeds are kept and only held-out examples are resampled. It shrinks
  with more seeds whatever their disagreement; reported beside, labelled as what it is.

Verdict: ``better`` (A below B: the interval lies below 0), ``worse`` (above 0) or ``not resolved``. Where several
claims are made at once (a preset's primary comparisons), ``holm`` adjusts their p-values (Holm 1979: step-down
Bonferroni, family-wise error at most 1 - level) and ``corrected_verdict`` keeps a verdict only where its adjusted
p-value is below 1 - level.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

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


MIN_SEEDS = 3  # fewer seeds cannot show how much they disagree: a seed-aware verdict needs at least this many


@dataclass(frozen=True)
class Interval:
    """A paired difference A - B: its value on the data, the bootstrap interval, and the per-seed values.

    ``seeds_resampled``: the interval is seed-aware (seeds and examples resampled), else examples only.
    ``p_value``: the bootstrap's two-sided p-value of "no difference"; ``t_p_value``: the paired t-test's over the
    per-seed differences (None with fewer than two seeds or no spread between them).
    """

    estimate: float
    low: float
    high: float
    per_seed: tuple[float, ...]
    level: float = 0.95
    seeds_resampled: bool = False
    p_value: float | None = None
    t_p_value: float | None = None

    @property
    def claim_p(self) -> float:
        """The p-value a claim is judged and corrected on: a seed-aware interval's larger of the bootstrap's and
        the paired t-test's (the bootstrap over a handful of seeds alone is too sure: it draws from the seeds seen),
        an examples-only interval's bootstrap p-value."""
        if self.seeds_resampled and (len(self.per_seed) < MIN_SEEDS or self.t_p_value is None):
            return 1.0  # a claim that cannot stand must not lower the others' Holm multipliers
        p = 1.0 if self.p_value is None else self.p_value
        return max(p, self.t_p_value) if self.seeds_resampled and self.t_p_value is not None else p

    @property
    def verdict(self) -> str:
        if self.seeds_resampled and (len(self.per_seed) < MIN_SEEDS or self.claim_p >= 1 - self.level):
            return UNRESOLVED
        if self.high < 0:
            return BETTER
        if self.low > 0:
            return WORSE
        return UNRESOLVED

    def __str__(self) -> str:
        return f"{self.estimate:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest of m is multiplied by m - i + 1
    (i from 1), made non-decreasing in that order and capped at 1. A claim stands at family-wise level alpha where its
    adjusted p-value is below alpha."""
    m = len(p_values)
    adjusted = [1.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * float(p_values[index])))
        adjusted[index] = running
    return adjusted


def corrected_verdict(interval: Interval, adjusted_p: float) -> str:
    """The interval's verdict where its multiplicity-adjusted p-value is below 1 - level, else "not resolved"."""
    return interval.verdict if adjusted_p < 1 - interval.level else UNRESOLVED


def paired_t(per_seed: Sequence[float] | np.ndarray) -> float | None:
    """The two-sided p-value of a paired t-test that the per-seed differences average 0 (None: fewer than two
    seeds)."""
    from scipy.stats import ttest_1samp

    values = np.asarray(per_seed, dtype=np.float64)
    if values.size < 2:
        return None
    if np.ptp(values) == 0:  # seeds in perfect agreement: t is infinite (p 0), or 0/0 where they all found 0
        return 1.0 if values[0] == 0 else 0.0
    return float(ttest_1samp(values, 0.0).pvalue)


def bootstrap_p(replicates: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "the difference is 0": twice the smaller tail at 0, with the +1 correction
    that keeps it above 0."""
    n = replicates.size
    below, above = (np.sum(replicates <= 0) + 1) / (n + 1), (np.sum(replicates >= 0) + 1) / (n + 1)
    return float(min(1.0, 2 * min(below, above)))


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


def replicate_differences(
    a: ExampleLosses, b: ExampleLosses, statistic: Statistic, replicates: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Per seed both have: the observed difference statistic(A) - statistic(B) (shape [seeds]), and its value on
    ``replicates`` paired resamples of every client's held-out examples (shape [seeds, replicates])."""
    paired = _paired_clients(a, b)
    observed, resampled_diff = np.zeros(len(paired)), np.zeros((len(paired), replicates))
    for row, (run_seed, clients) in enumerate(paired):
        losses = {name: np.zeros(len(clients)) for name in ("a", "b")}
        resampled = {name: np.zeros((replicates, len(clients))) for name in ("a", "b")}
        for column, client in enumerate(clients):
            n = np.asarray(a[run_seed][client][0]).size
            index = rng.integers(0, n, size=(replicates, n))
            for name, run in (("a", a), ("b", b)):
                loss, tokens = run[run_seed][client]
                losses[name][column] = client_loss(loss, tokens)
                resampled[name][:, column] = client_loss(loss, tokens, index)
        observed[row] = statistic(losses["a"][None])[0] - statistic(losses["b"][None])[0]
        resampled_diff[row] = statistic(resampled["a"]) - statistic(resampled["b"])
    return observed, resampled_diff


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_interval(
    a: ExampleLosses,
    b: ExampleLosses,
    statistic: Statistic,
    replicates: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    seeds_resampled: bool = True,
) -> Interval:
    """The paired difference statistic(A) - statistic(B), averaged over the seeds both have, with a percentile
    bootstrap interval. ``seeds_resampled``: hierarchical (each replicate draws as many seeds as there are, with
    replacement, and for each draw an independent paired resample of every client's held-out examples), with the
    paired t-test's p-value over the per-seed differences beside the bootstrap's. Else EXAMPLES ONLY: the seeds are
    kept and only held-out examples resampled (the same resample for A and B), which leaves seed-to-seed variation
    out."""
    rng = np.random.default_rng(seed)
    observed, resampled = replicate_differences(a, b, statistic, replicates, rng)
    if seeds_resampled:
        drawn_seeds = rng.integers(0, observed.size, size=(replicates, observed.size))
        drawn_examples = rng.integers(0, replicates, size=(replicates, observed.size))
        spread = resampled[drawn_seeds, drawn_examples].mean(axis=1)
    else:
        spread = resampled.mean(axis=0)
    low, high = _percentiles(spread, level)
    return Interval(
        float(observed.mean()),
        low,
        high,
        tuple(map(float, observed)),
        level,
        seeds_resampled=seeds_resampled,
        p_value=bootstrap_p(spread),
        t_p_value=paired_t(observed) if seeds_resampled else None,
    )


# What verdicts are made on, and the examples-only interval shown beside it (see the module docstring).
seed_aware_interval = partial(bootstrap_interval, seeds_resampled=True)
paired_interval = partial(bootstrap_interval, seeds_resampled=False)


def per_client_intervals(
    a: ExampleLosses,
    b: ExampleLosses,
    replicates: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    seeds_resampled: bool = True,
) -> dict[int, Interval]:
    """For every client both have: its loss under A minus under B, averaged over the seeds, with the seed-aware
    bootstrap (or, ``seeds_resampled=False``, examples only): who is helped or hurt, and whether by more than the
    noise."""
    clients = sorted({c for s in set(a) & set(b) for c in set(a[s]) & set(b[s])})
    out = {}
    for client in clients:
        only = {
            name: {s: {client: run[s][client]} for s in run if client in run[s]} for name, run in (("a", a), ("b", b))
        }
        out[client] = bootstrap_interval(
            only["a"], only["b"], mean_client, replicates, level, seed + client, seeds_resampled
        )
    return out
