"""``model.overrides``: per-base-model step sizes, validated up front and applied on the clients of that model."""

import shutil

import pytest
from conftest import ROOT
from flwr.common import Context, RecordDict

from common.config import ConfigError, pyproject_defaults
from strategies import load_run_config

SMOL, QWEN = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"


def simgrad_config(overrides: str):
    flat = pyproject_defaults(ROOT / "pyproject.toml")
    return load_run_config({**flat, "strategy": "simgrad", "model.overrides": overrides})


def test_a_model_reads_its_own_values_and_the_others_the_runs():
    cfg = simgrad_config(
        f"{QWEN}:pqlora.learning-rate=0.01, {QWEN}:personal.learning-rate=2e-3, {SMOL}:train.weight-decay=0.1"
    )
    qwen, smol = cfg.for_model(QWEN), cfg.for_model(SMOL)
    assert qwen.train_settings().learning_rate == 0.01 and smol.train_settings().learning_rate == 0.03
    assert qwen.to_flat()["personal.learning-rate"] == 2e-3 and smol.to_flat()["personal.learning-rate"] == 0.0
    assert smol.train.weight_decay == 0.1 and qwen.train.weight_decay == 0.0
    assert cfg.train_settings().learning_rate == 0.03  # the server's view: the run's values
    assert cfg.for_model("org/another-model") is cfg
    # the flat form round-trips (what the ServerApp logs and bench.compare records)
    assert load_run_config(cfg.to_flat()).model.overrides == cfg.model.overrides
    # as with any key, a section the strategy does not read is validated, then unused (a FedAvg run of the same file)
    fedavg = load_run_config({**cfg.to_flat(), "strategy": "fedavg"})
    assert fedavg.for_model(QWEN).train_settings().learning_rate == fedavg.train.learning_rate


@pytest.mark.parametrize(
    "overrides, says",
    [
        (f"{QWEN}:pqlora.r=4", "pqlora.r cannot differ by base model"),
        (f"{QWEN}:train.local-steps=2", "train.local-steps cannot differ by base model"),
        (f"{QWEN}:pqlora.learning-rate=5", "pqlora.learning-rate: Input should be less than or equal to 1"),
        (f"{QWEN}:atlas.k=2", "atlas.k cannot differ by base model"),
        (f"{QWEN}:model.name=x", "'model' is not a section with per-model keys"),
        ("qwen-coder:pqlora.learning-rate=0.01", "'qwen-coder' is not a built-in model"),
        ("pqlora.learning-rate=0.01", "expected 'model:section.key=value' pairs"),
    ],
)
def test_a_bad_override_is_refused_before_round_one_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match="model.overrides") as err:
        simgrad_config(overrides)
    assert says in str(err.value)


def test_the_client_of_an_overridden_model_trains_with_its_values(tiny_llama_dir, tmp_path):
    """Two clients in one process on two base models: only the overridden model's client gets the new gate init
    (in its attached PQ-LoRA) and learning rate."""
    from client_app.runtime import get_runtime
    from common.adapters.pqlora.model import _gates

    other = tmp_path / "other-model"
    shutil.copytree(tiny_llama_dir, other)
    run_config = {
        "strategy": "simgrad",
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "model.overrides": f"{other}:pqlora.gate-init=2.0, {other}:pqlora.learning-rate=0.005",
        "pqlora.blocks": 2,
        "pqlora.r": 2,
        "simgrad.route-budget": 2,
        "data.tasks": "boolq",
        "data.max-examples-per-task": 20,
        "run-dir": str(tmp_path / "run"),
    }

    def runtime(partition: int, node_config: dict):
        node_config = {"partition-id": partition, "num-partitions": 2, **node_config}
        context = Context(
            run_id=1, node_id=partition + 1, node_config=node_config, state=RecordDict(), run_config=run_config
        )
        return get_runtime(context)

    plain, overridden = runtime(0, {}), runtime(1, {"model": str(other)})
    assert overridden.cfg.train_settings().learning_rate == 0.005 and plain.cfg.train_settings().learning_rate == 0.03
    assert [g.item() for g in _gates(overridden.adapter.model).logits] == [2.0, 2.0]
    assert [g.item() for g in _gates(plain.adapter.model).logits] == [0.0, 0.0]
