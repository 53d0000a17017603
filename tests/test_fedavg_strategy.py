"""The FedAvg strategy without Flower: one global adapter per model family; nodes may join mid-run."""

import numpy as np
import pytest

from strategies import ClientInfo, GroupResult, load_run_config
from strategies.fedavg import FedAvg


def adapter(value: float) -> dict:
    return {"x.lora_A.weight": np.full((2, 3), value, np.float32), "x.lora_B.weight": np.zeros((3, 2), np.float32)}


def test_a_node_that_joins_mid_run_trains_from_the_current_global_adapter():
    strategy = FedAvg()
    strategy.initialise({1: ClientInfo(1, 0, "smollm2", adapter(0.0)), 2: ClientInfo(2, 1, "smollm2", adapter(0.0))})
    (group,) = strategy.train_groups(1, [1, 2])
    strategy.update(1, [GroupResult(group.name, adapter(0.5), 16.0, [1, 2])])
    strategy.initialise({9: ClientInfo(9, 2, "smollm2", adapter(0.0))})  # joined after round 1 with a fresh adapter
    (group,) = strategy.train_groups(2, [1, 2, 9])
    assert group.members == [1, 2, 9]
    np.testing.assert_array_equal(group.start[9]["x.lora_A.weight"], adapter(0.5)["x.lora_A.weight"])
    np.testing.assert_array_equal(strategy.eval_arrays(9)["x.lora_A.weight"], adapter(0.5)["x.lora_A.weight"])


def wide(value: float) -> dict:
    """Another base model's LoRA: other shapes (the width differs)."""
    return {"x.lora_A.weight": np.full((2, 5), value, np.float32), "x.lora_B.weight": np.zeros((5, 2), np.float32)}


def two_families() -> FedAvg:
    strategy = FedAvg()
    strategy.initialise(
        {
            1: ClientInfo(1, 0, "smol", adapter(0.0)),
            2: ClientInfo(2, 1, "qwen/7b", wide(0.0)),
            3: ClientInfo(3, 2, "smol", adapter(0.0)),
            4: ClientInfo(4, 3, "qwen/7b", wide(0.0)),
        }
    )
    return strategy


def test_two_model_families_are_averaged_separately_and_resume_from_a_checkpoint():
    strategy = two_families()
    groups = {g.name: g for g in strategy.train_groups(1, [1, 2, 3, 4])}
    assert (
        sorted(groups) == ["qwen_2f_7b", "smol"]
        and groups["smol"].members == [1, 3]
        and groups["qwen_2f_7b"].members == [2, 4]
    )
    strategy.update(
        1, [GroupResult("smol", adapter(0.25), 8.0, [1, 3]), GroupResult("qwen_2f_7b", wide(0.75), 8.0, [2, 4])]
    )
    assert (
        strategy.eval_arrays(3)["x.lora_A.weight"][0, 0] == 0.25
        and strategy.eval_arrays(4)["x.lora_A.weight"][0, 0] == 0.75
    )

    state = strategy.state_dict()
    assert sorted(state) == ["global-qwen_2f_7b", "global-smol"]
    resumed = two_families()  # a restarted ServerApp: same clients, then the checkpoint
    resumed.load_state_dict(state)
    for nid in (1, 2, 3, 4):
        np.testing.assert_array_equal(
            resumed.eval_arrays(nid)["x.lora_A.weight"], strategy.eval_arrays(nid)["x.lora_A.weight"]
        )
    saved = {a.name: a for a in resumed.final_adapters()}
    assert (
        sorted(saved) == ["qwen_2f_7b", "smol"] and saved["qwen_2f_7b"].base_model == "qwen/7b"
    )  # PEFT needs the real name


def test_resume_refuses_a_checkpoint_without_every_family():
    single = FedAvg()
    single.initialise({1: ClientInfo(1, 0, "smol", adapter(0.0))})
    strategy = two_families()
    with pytest.raises(ValueError, match="model family 'qwen_2f_7b'"):
        strategy.load_state_dict({"global-smol": adapter(0.1)})
    single.load_state_dict({"global": adapter(0.3)})  # one family: the plain "global" checkpoint
    assert single.eval_arrays(1)["x.lora_A.weight"][0, 0] == np.float32(0.3)
    assert [(a.name, a.base_model) for a in single.final_adapters()] == [("", "smol")]


def test_secure_fedavg_refuses_model_families_under_three_before_round_one():
    """With model.partition-models giving a family of 2 and one of 1, SecAgg+ was attempted every round on groups
    that leak (2) or cannot run (1); now the run stops before round 1, naming the families."""
    clients = {n: ClientInfo(n, n, "smol" if n < 3 else ("qwen" if n < 5 else "tiny"), adapter(0.0)) for n in range(6)}
    with pytest.raises(ValueError, match=r"\{'qwen': 2, 'tiny': 1\}.*fewer than 3"):
        FedAvg(secure=True).initialise(clients)
    FedAvg(secure=False).initialise(clients)  # plain mode averages a family of any size
    ok = FedAvg(secure=True)
    ok.initialise({n: ClientInfo(n, n, "smol", adapter(0.0)) for n in range(3)})
    with pytest.raises(ValueError, match="'tiny': 1"):  # a node that would start a family of its own is refused
        ok.initialise({7: ClientInfo(7, 7, "tiny", adapter(0.0))})
    ok.initialise({8: ClientInfo(8, 8, "smol", adapter(0.0))})  # one that joins a family of 3 is taken
    assert ok.family_of[8] == "smol"


def test_resuming_with_another_lora_rank_or_model_is_refused_naming_the_key():
    from server_app.app import _checkpoint_meta, check_resumable

    old_cfg = load_run_config({"lora.r": 2})
    saved = FedAvg()
    saved.initialise({1: ClientInfo(1, 0, "smol", adapter(0.0))})
    meta = {"strategy": "fedavg", "round": 1, **_checkpoint_meta(old_cfg, [1])}
    state = saved.state_dict()

    wider = {k: np.zeros((v.shape[0] * 2, *v.shape[1:]), np.float32) for k, v in adapter(0.0).items()}
    now = FedAvg()
    now.initialise({1: ClientInfo(1, 0, "smol", wider)})
    with pytest.raises(ValueError, match=r"lora.r: 2 -> 4.*adapter shapes differ"):
        check_resumable(load_run_config({"lora.r": 4}), now, meta, state, "ckpt")
    with pytest.raises(ValueError, match=r"model.name: 'smollm2-135m-instruct' -> 'org/other'"):
        check_resumable(load_run_config({"lora.r": 2, "model.name": "org/other"}), saved, meta, state, "ckpt")
    check_resumable(load_run_config({"lora.r": 2, "train.learning-rate": 0.01}), saved, meta, state, "ckpt")
    group, arrays = next(iter(state.items()))
    lost = next(iter(arrays))  # a key a later version added (as VEMoE's slots/live once was): named, not a KeyError
    older = {**state, group: {k: v for k, v in arrays.items() if k != lost}}
    with pytest.raises(ValueError, match=f"lacks {group}/{lost}"):
        check_resumable(load_run_config({"lora.r": 2}), saved, meta, older, "ckpt")
