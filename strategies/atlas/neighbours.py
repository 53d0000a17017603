"""ATLAS's groups and its MIRA step inside the clusters (seed 003, phase 4) as pure functions: the named groups of
a clustering, what trains as one unit, the adjacency a_kl inside the clusters (``Neighbourhood``) and each
client's neighbour term N_k = sum_l a_kl W_l over its own cluster mixed from the units' means
(``strategies.aggregation.mix_group_means``). NumPy in, NumPy out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..aggregation import mix_group_means
from ..base import Arrays
from ..fingerprint.laplacian import normalised_adjacency, rbf_adjacency

Unit = tuple[str, list[int]]  # (name, partitions) of a group or of what trains as one


def named_groups(group_labels: Mapping[str, np.ndarray], members: Mapping[str, Sequence[int]]) -> list[Unit]:
    """Every group of every family (families sorted, then labels): ``<family>-c<label>`` with its partitions, given
    each family's group label per member (in ``members`` order)."""
    out = []
    for family, labels in sorted(group_labels.items()):
        for label in sorted(set(labels.tolist())):
            out.append((f"{family}-c{label}", [p for p, g in zip(members[family], labels.tolist()) if g == label]))
    return out


def training_units(groups: list[Unit], laplacian: bool, secure: bool) -> list[Unit]:
    """What trains as one group: the groups, or with a Laplacian step in plaintext every client alone
    (``p<partition>``), so that the server has every W_l for the exact neighbour terms."""
    if laplacian and not secure:
        return [(f"p{p}", [p]) for _, partitions in groups for p in partitions]
    return groups


@dataclass(frozen=True)
class Neighbourhood:
    """A family's adjacency for the Laplacian step: the RBF bandwidth, a_kl before the clusters and the
    normalisation (the heatmap's) and a_kl row-normalised inside the clusters (both in the family's member order)."""

    alpha: float
    raw: np.ndarray
    adjacency: np.ndarray

    def row(self, eta: float) -> dict[str, Any]:
        """Its part of the family's metrics row, with the step size ``eta``."""
        return {
            "laplacian_eta": eta,
            "alpha": self.alpha,
            "adjacency_raw": self.raw.round(6).tolist(),
            "adjacency": self.adjacency.round(6).tolist(),
        }


def neighbourhood(points: np.ndarray, alpha: float, clusters: Sequence[int]) -> Neighbourhood:
    """The adjacency over these (reduced) fingerprints with the RBF bandwidth ``alpha``, a_kl = 0 across
    ``clusters`` once normalised."""
    return Neighbourhood(alpha, rbf_adjacency(points, alpha), normalised_adjacency(points, alpha, clusters))


def neighbour_terms(
    adjacency: np.ndarray,
    members: Sequence[int],
    group: Sequence[int],
    units: list[Unit],
    means: Mapping[str, Arrays],
    names: Collection[str],
) -> list[tuple[int, str, Arrays]]:
    """(partition, its unit, N_k) for the clients of one ``group``: N_k mixed by the family's ``adjacency`` (rows
    and columns in ``members`` order) from the means of the units inside the group (one shape: the group's wire
    ranks; exact when every client is its own unit). A client none of whose neighbours trained (its term lacks
    some of the adapter's ``names``) gets its own unit's mean (no pull); one whose unit did not train either, none.
    """
    rows = [list(members).index(p) for p in group]
    local = {p: i for i, p in enumerate(group)}
    inside = [(name, ps) for name, ps in units if ps[0] in local]
    mixed = mix_group_means(
        adjacency[np.ix_(rows, rows)],
        [[local[p] for p in ps] for _, ps in inside],
        [means.get(name) for name, _ in inside],
    )
    out = []
    for unit, ps in inside:
        for p in ps:
            term: Arrays | None = mixed[local[p]]
            if not set(names) <= set(term or {}):
                term = means.get(unit)
            if term is not None:
                out.append((p, unit, term))
    return out
