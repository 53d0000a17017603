import tomllib

import pytest

from common.config import ConfigError, RunConfig
from conftest import ROOT


def pyproject_run_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def flatten(table: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_pyproject_defaults_validate_and_cover_every_key():
    flat = flatten(pyproject_run_config())
    cfg = RunConfig.from_flat(flat)
    # pyproject lists every key of the model, and the values round-trip
    assert set(flat) == set(cfg.to_flat())
    assert cfg.to_flat() == {k: (float(v) if isinstance(cfg.to_flat()[k], float) else v) for k, v in flat.items()}


@pytest.mark.parametrize(
    "override, key",
    [
        ({"train.local-steps": 0}, "train.local-steps"),
        ({"lora.r": -1}, "lora.r"),
        ({"model.quantization": "int3"}, "model.quantization"),
        ({"data.partitioning": "random"}, "data.partitioning"),
        ({"train.lokal-steps": 3}, "train.lokal-steps"),
        ({"strategy": "nope"}, "strategy"),
        ({"secure": True, "min-train-replies": 2}, "min-train-replies"),
        ({"num-server-rounds": "many"}, "num-server-rounds"),
    ],
)
def test_invalid_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flat(override)
    assert f"{key}:" in str(err.value)


def test_csv_lists_and_nesting():
    cfg = RunConfig.from_flat({"lora.target-modules": "q_proj, k_proj ,v_proj", "data.tasks": "boolq"})
    assert cfg.lora.target_modules == ["q_proj", "k_proj", "v_proj"]
    assert cfg.data.tasks == ["boolq"]
    with pytest.raises(ConfigError, match="lora"):
        RunConfig.from_flat({"lora": 3, "lora.r": 4})
