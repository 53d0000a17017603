"""Three organisations' own data, for the demo and the deployment tests: real text (the built-in bank's BoolQ,
ASDiv and CommonsenseQA) written out in three formats, as three members would bring it.

    python -m common.data members DIR     # DIR/node-0/chat.jsonl, DIR/node-1/alpaca.json,
                                          # DIR/node-2/prompt-completion.parquet

A node is then started with node-config ``data-path='DIR/node-<i>/<file>'``; nothing in the run config names them.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.core_sections import DataSection

from .bank import load_task_bank
from .example import Example

# partition -> (the bank's task it holds, its file in its node's directory)
MEMBERS = {0: ("boolq", "chat.jsonl"), 1: ("asdiv", "alpaca.json"), 2: ("commonsenseqa", "prompt-completion.parquet")}


def write_members(directory: Path, examples_per_member: int = 60) -> dict[int, tuple[Path, list[Example]]]:
    """Write each member's file under ``directory/node-<partition>/``; partition -> (its file, its examples)."""
    from datasets import Dataset

    tasks = [task for task, _ in MEMBERS.values()]
    bank = load_task_bank(DataSection(tasks=tasks, max_examples_per_task=examples_per_member))
    out = {}
    for partition, (task, name) in MEMBERS.items():
        examples = [e for e in bank if e.task == task]
        path = directory / f"node-{partition}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):  # OpenAI-style chat, with a system message
            system = {"role": "system", "content": "Answer briefly."}
            rows = [
                {
                    "messages": [
                        system,
                        {"role": "user", "content": e.prompt},
                        {"role": "assistant", "content": e.answer},
                    ]
                }
                for e in examples
            ]
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        elif name.endswith(".json"):  # Alpaca: one JSON array
            path.write_text(json.dumps([{"instruction": e.prompt, "input": "", "output": e.answer} for e in examples]))
        else:  # prompt-completion in Parquet
            Dataset.from_list([{"prompt": e.prompt, "completion": e.answer} for e in examples]).to_parquet(str(path))
        path.chmod(0o644)  # the demo's containers read it as another user
        out[partition] = (path, examples)
    return out
