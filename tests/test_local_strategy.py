"""The local-only baseline (``strategy = "local"``): one group per client with nothing in it, no adapter bytes
after the initial query, each client training and keeping its own adapter (LoRA or PQ-LoRA), in plain and secure
mode; and the validation split it is tuned on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_toy_strategy import config, run

from common.config import ConfigError, DataSection
from common.data import client_data
from common.messages import RoundPart, read_train
from common.records import read_sent_adapter, read_train_instruction, train_instruction
from strategies import ClientInfo, load_run_config, strategy_spec
from strategies.local import LocalOnly


def test_local_sends_nothing_and_groups_each_client_alone():
    server = LocalOnly()
    server.initialise({7: ClientInfo(7, 0, "m", {"w": np.ones(3, np.float32)}), 9: ClientInfo(9, 1, "m", {})})
    groups = server.train_groups(1, [7, 9, 11])  # 11 never answered the initial query: not trained
    expected = [("partition-0", [7], {7: {}}), ("partition-1", [9], {9: {}})]
    assert [(g.name, g.members, g.start) for g in groups] == expected
    assert server.eval_arrays(7) == {} and server.state_dict() == {} and server.final_adapters() == []
    assert not server.aggregates  # secure mode has nothing to mask: the plain transport carries its metrics
    content = train_instruction({}, RoundPart(server_round=1).wire())
    arrays, settings = read_train_instruction(content, {"w": np.ones(3, np.float32)})
    # "nothing sent": the client starts from its own
    assert arrays is None and read_train(settings, None).round.server_round == 1
    sent = train_instruction({"w": np.ones(3, np.float32)}, {})
    (record,) = sent.array_records.values()
    assert read_sent_adapter(record, {"w": np.zeros(3, np.float32)})["w"].tolist() == [1, 1, 1]


@pytest.mark.parametrize(("adapter", "keys"), [("lora", ("local.adapter",)), ("pqlora", ("pqlora.local",))])
def test_the_config_picks_the_adapter_kind(adapter, keys):
    cfg = load_run_config({"strategy": "local", "local.adapter": adapter})
    assert cfg.adapter == adapter
    assert set(keys) <= set(strategy_spec("local").state_keys(cfg))
    with pytest.raises(ConfigError, match="local.adapter"):
        load_run_config({"strategy": "local", "local.adapter": "prefix"})


def test_a_validation_split_leaves_training_alone_and_never_overlaps_the_test_split():
    base = {"tasks": ["boolq"], "max_examples_per_task": 50}
    plain_train, test = client_data(DataSection(**base), 0, 1, 0)
    train, validation = client_data(DataSection(**base, validation_fraction=0.2, eval_split="validation"), 0, 1, 0)
    same_train, same_test = client_data(DataSection(**base, validation_fraction=0.2), 0, 1, 0)
    assert train == same_train and same_test == test  # tuning and reporting runs train on the same examples
    # the validation split is carved from what would otherwise be training examples (by content: about a fifth)
    assert 3 <= len(validation) <= 15 and len(train) == len(plain_train) - len(validation)
    prompts = {e.prompt for e in validation}
    assert not prompts & {e.prompt for e in test} and not prompts & {e.prompt for e in train}
    with pytest.raises(ConfigError, match="data.eval-split"):
        load_run_config({"data.eval-split": "validation"})


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.parametrize(("adapter", "secure"), [("lora", True), ("pqlora", False)])
def test_each_client_trains_and_keeps_its_own_adapter(tiny_llama_dir, tmp_path, adapter, secure):
    run_dir = tmp_path / "run"
    extra = {"strategy": "local", "local.adapter": adapter, "secure": secure, "num-server-rounds": 3}
    settings = {"pqlora.learning-rate": 0.1, "pqlora.blocks": 2, "train.local-steps": 4, "eval.max-examples": 4}
    run(config(tiny_llama_dir, run_dir, **extra, **settings))
    rows = [r for r in _rows(run_dir) if r["node"] is not None]
    assert len(rows) == 12 and all(r["eval_loss"] is not None for r in rows)
    assert all(r["bytes_up"] == 0 and r["bytes_down"] == 0 for r in rows)  # no adapter travelled after the query
    assert all(r["accepted"] for r in rows if r["round"] > 0)
    loss = {(r["partition_id"], r["round"]): r["eval_loss"] for r in rows}
    assert all(loss[p, 3] < loss[p, 0] for p in range(3)), loss  # every client's own adapter learned
    assert sum(loss[p, 3] for p in range(3)) < sum(loss[p, 1] for p in range(3)), loss  # and kept what it trained
    saved = [run_dir / "client-adapters" / f"partition-{p}" for p in range(3)]
    assert all(any(d.iterdir()) for d in saved) and not (run_dir / "adapter").exists()
