"""Which split an example is in: decided by a stable hash of its content, never by ``seed`` or by file order.

``split_of`` maps the example's content hash (``Example.content_key``: case and spacing aside, task aside) to a
number u in [0, 1): u < test-fraction is test, the next validation-fraction of the rest is validation, the rest is
training. The same example is therefore in the same split for every seed, in every file order, on every machine
and after every restart, and copies of a test example (the same text twice, or in two formats) are test examples
too: they are never trained on. A validation example of one seed is a validation example of every seed, so no
seed's tuning ever looks at a test example.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from .example import Example, content_hash

Split = Literal["test", "validation", "train"]
_SPLIT_SALT = "tessera-split-v1"  # changing it moves every example: a new rule, to be named in the reports
SPLIT_RULE = "content-hash v1"  # recorded with every run's results (``bench.compare``)


def unit_interval(example: Example) -> float:
    """The example's place in [0, 1) under the split rule."""
    return content_hash(example, _SPLIT_SALT) / 2.0**64


def split_of(example: Example, test_fraction: float, validation_fraction: float) -> Split:
    """``test`` (u < test-fraction), ``validation`` (the next validation-fraction of the rest) or ``train``."""
    return _split_at(unit_interval(example), test_fraction, validation_fraction)


def _split_at(u: float, test_fraction: float, validation_fraction: float) -> Split:
    if u < test_fraction:
        return "test"
    if u < test_fraction + (1 - test_fraction) * validation_fraction:
        return "validation"
    return "train"


def split_examples(
    examples: Iterable[Example], test_fraction: float, validation_fraction: float
) -> dict[Split, list[Example]]:
    """The examples by split, each split in the order of its examples' hashes (a fixed order, whatever the file's:
    ``eval.max-examples`` then takes the same examples everywhere)."""
    out: dict[Split, list[tuple[float, Example]]] = {"test": [], "validation": [], "train": []}
    for example in examples:
        u = unit_interval(example)  # hashed once: it decides the split and the order
        out[_split_at(u, test_fraction, validation_fraction)].append((u, example))
    return {name: [e for _, e in sorted(pairs, key=lambda p: p[0])] for name, pairs in out.items()}


def split_beside_test_file(
    examples: Iterable[Example], test: list[Example], validation_fraction: float
) -> tuple[dict[Split, list[Example]], int]:
    """With an explicit test file: the test split is that file; the examples are split into validation and training
    by the same hash, and any that is a copy of a test example (same ``content_key``) is left out of both. Returns
    the splits and how many copies were left out."""
    keys = {e.content_key() for e in test}
    kept: list[Example] = []
    dropped = 0
    for example in examples:
        if example.content_key() in keys:
            dropped += 1
        else:
            kept.append(example)
    splits = split_examples(kept, 0.0, validation_fraction)
    order = sorted(test, key=unit_interval)
    return {"test": order, "validation": splits["validation"], "train": splits["train"]}, dropped
