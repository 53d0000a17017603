"""The Natural-Instructions source without the 358 MB download: the sub-tasks extracted from a crafted sdist, the
keyword assignment of tasks to categories (a category with no task is an error naming it), and the client data
built from them."""

import io
import json
import tarfile

import pytest

from common.assets import NI_PREFIX, _extract_natural_instructions
from common.data import assign_categories, client_data
from strategies import load_run_config

TASKS = {
    "subtask001_quoref_question_generation": ("Definition: write questions about the passage.", "q"),
    "subtask002_quoref_answer_generation": ("Definition: write answers to the questions.", "a"),
    "subtask003_mctaco_question_generation_event_duration": ("Definition: write a question on duration.", "d"),
    "subtask004_mctaco_answer_generation_event_duration": ("Definition: answer a question on duration.", "e"),
}


def _sdist(path):
    with tarfile.open(path, "w:gz") as archive:

        def add(name, payload):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))

        add(f"bigbench-1.0.0/{NI_PREFIX}task.json", b"{}")  # the parent task: not a sub-task
        add("bigbench-1.0.0/bigbench/benchmark_tasks/other/task.json", b"{}")
        for name, (definition, answer) in TASKS.items():
            rows = [{"input": f"{name} input {i}", "target": [f"{answer}{i}"]} for i in range(30)]
            task = {"description": definition, "examples": rows}
            add(f"bigbench-1.0.0/{NI_PREFIX}{name}/task.json", json.dumps(task).encode())


def test_the_sub_tasks_are_extracted_with_their_definitions(tmp_path):
    _sdist(tmp_path / "bigbench.tar.gz")
    target = tmp_path / "cache" / "data" / "natural-instructions"
    _extract_natural_instructions(tmp_path / "bigbench.tar.gz", target)
    index = json.loads((target / "index.json").read_text())
    assert sorted(index) == sorted(TASKS)  # neither the parent task nor another benchmark's
    rows = [
        json.loads(line) for line in (target / "subtask002_quoref_answer_generation.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 30 and rows[3] == {"input": "subtask002_quoref_answer_generation input 3", "target": "a3"}


def test_categories_are_assigned_by_keyword_and_a_missing_one_is_named():
    definitions = {name: definition for name, (definition, _) in TASKS.items()}
    chosen = assign_categories(definitions, ["question generation", "duration"], 2)
    assert chosen == {
        "question generation": [
            "subtask001_quoref_question_generation",
            "subtask003_mctaco_question_generation_event_duration",
        ],
        "duration": ["subtask004_mctaco_answer_generation_event_duration"],  # a task goes to the first category
    }
    with pytest.raises(ValueError, match="'translation' matches no"):
        assign_categories(definitions, ["question generation", "translation"], 2)


def test_clients_get_the_categories_as_tasks(tmp_path, monkeypatch):
    _sdist(tmp_path / "bigbench.tar.gz")
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    _extract_natural_instructions(tmp_path / "bigbench.tar.gz", tmp_path / "cache" / "data" / "natural-instructions")
    cfg = load_run_config({"data.source": "natural-instructions", "data.max-examples-per-task": 40})
    first, _ = client_data(cfg.data, 0, 2, 0)
    second, held_out = client_data(cfg.data, 1, 2, 0)
    assert {e.task for e in first} == {"question generation"} and {e.task for e in second} == {"answer generation"}
    assert all(e.prompt.startswith(("write", "answer")) and "\nInput: " in e.prompt for e in first + second), first[0]
    assert len(second) + len(held_out) <= 40 and held_out
    with pytest.raises(ValueError, match="data.keyword-categories"):
        load_run_config({"data.source": "natural-instructions", "data.keyword-categories": ""})


def test_the_hub_copy_gives_the_clients_the_same_examples(tmp_path, monkeypatch):
    """``data.source='Muennighoff/natural-instructions'`` (one row per example, with its sub-task's name and
    definition) builds the same client data as the offline bank of the same sub-tasks. The hub is not reachable
    here: ``datasets.load_dataset`` returns the hub's columns for these sub-tasks."""
    import datasets

    _sdist(tmp_path / "bigbench.tar.gz")
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    _extract_natural_instructions(tmp_path / "bigbench.tar.gz", tmp_path / "cache" / "data" / "natural-instructions")
    hub_rows = [
        {"task_name": name, "id": f"{name}-{i}", "definition": d, "inputs": f"{name} input {i}", "targets": f"{a}{i}"}
        for name, (d, a) in TASKS.items()
        for i in range(30)
    ]
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda source, split: asked.append((source, split)) or hub_rows)
    extra = {"data.max-examples-per-task": 40, "data.keyword-categories": "question generation,duration"}
    offline = load_run_config({"data.source": "natural-instructions", **extra}).data
    hub = load_run_config({"data.source": "Muennighoff/natural-instructions", **extra}).data
    for partition in (0, 1):
        assert client_data(hub, partition, 2, 0) == client_data(offline, partition, 2, 0)
    assert asked and set(asked) == {("Muennighoff/natural-instructions", "train")}
    assert {e.task for e in client_data(hub, 1, 2, 0)[0]} == {"duration"}
