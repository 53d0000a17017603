"""Record-level DP-SGD (``common.dpsgd``, ``common.record_privacy``, ``client_app.record_dp``): one example moves a
step's summed gradient by at most C, whatever the batch's padding, packing or micro-batches; each example's loss is
its own answer-token mean; the accountant matches the library's documented value; the calibrated noise spends the
target and 1 % less would not; the budget is the member's; its steps survive a restarted node."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from client_app import member_ledger, record_dp
from common.adapters import ADAPTER_KINDS, attach_lora
from common.adapters.lora import LoraSection
from common.config import TrainSection
from common.data import Example
from common.dpsgd import clipped_gradient_sum, poisson_batch, private_train_round
from common.evaluation import answer_loss
from common.model import load_base_model, load_tokenizer
from common.record_privacy import Steps, effective_budget, record_epsilon, record_noise_for, sampling_rate
from common.training import encode, mean_answer_loss, to_device
from strategies import load_run_config

EXAMPLES = [Example("toy", f"What is {i} plus {i}?", f"{2 * i} " * (1 + i % 4)) for i in range(12)]


@pytest.fixture()
def tiny(tiny_llama_dir):
    model = load_base_model(str(tiny_llama_dir), quantization="fp32", device="cpu")
    return attach_lora(model, LoraSection(r=4, alpha=8), seed=0), load_tokenizer(str(tiny_llama_dir))


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("settings", [{}, {"micro_batch_size": 1}, {"packing": True}, {"loss_logits": "all"}])
def test_one_example_moves_the_summed_clipped_gradient_by_at_most_c(tiny, settings):
    model, tokenizer = tiny
    cfg = TrainSection(batch_size=4, **settings)
    params = _params(model)
    batch = [encode(tokenizer, e, 64) for e in EXAMPLES[:6]]
    clip = 1e-3  # far below every example's gradient norm: every one is clipped
    summed, losses, norms = clipped_gradient_sum(model, params, batch, tokenizer.pad_token_id, cfg, clip)
    assert min(norms) > clip and len(losses) == 6
    for left_out in range(6):  # add-or-remove adjacency: the batch without one example
        without = clipped_gradient_sum(
            model, params, batch[:left_out] + batch[left_out + 1 :], tokenizer.pad_token_id, cfg, clip
        )[0]
        moved = float(torch.linalg.vector_norm(_flat(summed) - _flat(without)))
        assert moved <= clip * (1 + 1e-4), (left_out, moved)
        assert moved == pytest.approx(clip, rel=1e-3)  # clipped to exactly C: the bound is met, not loose
    # an example's gradient is the one of its own mean answer-token loss, computed alone
    model.zero_grad()
    alone = mean_answer_loss(model, to_device(_collated(batch[0], tokenizer), "cpu"), cfg)
    grads = torch.autograd.grad(alone, params)
    first = clipped_gradient_sum(model, params, batch[:1], tokenizer.pad_token_id, cfg, 1e9)[0]
    torch.testing.assert_close(_flat(first), _flat(grads), rtol=1e-5, atol=1e-7)
    assert losses[0] == pytest.approx(float(alone))


@pytest.mark.parametrize("name", sorted(ADAPTER_KINDS))
def test_every_adapter_kind_that_trains_goes_through_the_per_example_path(tiny_llama_dir, name):
    """Every adapter kind as a client trains it (PQ-LoRA, the experts with their routers, SubLoRA's alpha, the dual
    paths' personal LoRA): one example moves the clipped sum by exactly C, an example's gradient is its own, and a
    step changes nothing but gradients (no buffer or statistic of the model learns from the records outside them)."""
    from flwr.app import RecordDict
    from test_adapters_start_as_identity import TINY, route

    from common.adapters import ClientState, adapter_kind

    kind = adapter_kind(name)
    adapter = kind(load_base_model(str(tiny_llama_dir), quantization="fp32", device="cpu"), load_run_config(TINY))
    adapter.begin(ClientState(RecordDict(), kind.state_keys), adapter.initial)
    route(adapter)
    adapter.prepare_training()
    model = adapter.model
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    cfg = TrainSection(batch_size=4, micro_batch_size=2)
    params = _params(model)
    assert params, name
    frozen = {n: t.detach().clone() for n, t in model.state_dict().items()}
    batch = [encode(tokenizer, e, 64) for e in EXAMPLES[:5]]
    clip = 1e-6
    summed, _, norms = clipped_gradient_sum(model, params, batch, tokenizer.pad_token_id, cfg, clip)
    assert min(norms) > clip, (name, norms)  # every trainable part has a gradient to clip
    for left_out in (0, 4):
        without = clipped_gradient_sum(
            model, params, batch[:left_out] + batch[left_out + 1 :], tokenizer.pad_token_id, cfg, clip
        )[0]
        assert float(torch.linalg.vector_norm(_flat(summed) - _flat(without))) == pytest.approx(clip, rel=1e-3)
    alone = mean_answer_loss(model, to_device(_collated(batch[2], tokenizer), "cpu"), cfg)
    own = clipped_gradient_sum(model, params, batch[2:3], tokenizer.pad_token_id, cfg, 1e9)[0]
    torch.testing.assert_close(_flat(own), _flat(torch.autograd.grad(alone, params, allow_unused=False)))
    after = model.state_dict()
    assert all(torch.equal(frozen[n], after[n]) for n in frozen), name


def _collated(example, tokenizer):
    from common.training import collate

    return collate([example], tokenizer.pad_token_id)


def test_the_loss_is_an_example_mean_not_a_token_mean(tiny):
    """A long answer and a short one count once each: the clipped sum with no clipping is the sum of each example's
    own mean-loss gradient, not the gradient of the tokens' mean over the batch."""
    model, tokenizer = tiny
    cfg = TrainSection(batch_size=2)
    params = _params(model)
    short, long = encode(tokenizer, EXAMPLES[0], 64), encode(tokenizer, EXAMPLES[3], 64)
    summed = clipped_gradient_sum(model, params, [short, long], tokenizer.pad_token_id, cfg, 1e9)[0]
    each = [
        torch.autograd.grad(mean_answer_loss(model, to_device(_collated(e, tokenizer), "cpu"), cfg), params)
        for e in (short, long)
    ]
    torch.testing.assert_close(_flat(summed), _flat(each[0]) + _flat(each[1]), rtol=1e-5, atol=1e-7)
    token_mean = mean_answer_loss(model, to_device(_batch(tokenizer, [short, long]), "cpu"), cfg)
    token_grad = _flat(torch.autograd.grad(token_mean, params))
    assert not torch.allclose(_flat(summed) / 2, token_grad, rtol=1e-3)  # the token mean weighs the long one more


def _batch(tokenizer, batch):
    from common.training import collate

    return collate(batch, tokenizer.pad_token_id)


def test_poisson_sampling_draws_each_record_with_its_rate():
    rng = np.random.default_rng(0)
    sizes = [len(poisson_batch(rng, 10_000, 0.01)) for _ in range(200)]
    assert np.mean(sizes) == pytest.approx(100, rel=0.05) and np.std(sizes) == pytest.approx(math.sqrt(99), rel=0.2)


def test_dp_sgd_with_little_noise_learns_and_with_much_noise_the_update_is_noise(tiny):
    model, tokenizer = tiny
    cfg = TrainSection(local_steps=15, batch_size=4, learning_rate=2e-2)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    before = answer_loss(model, tokenizer, EXAMPLES, 4, 64)
    metrics = private_train_round(model, tokenizer, EXAMPLES, cfg, 2e-2, q=4 / 12, noise_multiplier=0.01, clip=10.0)
    after = answer_loss(model, tokenizer, EXAMPLES, 4, 64)
    assert after < before - 0.1, (before, after)  # plain training of the same steps: 10.84 -> 10.57
    assert metrics["train_examples"] == 60  # the expected examples (15 steps x 4): what the member is weighted by
    assert metrics["train_sampled"] > 0
    # with z = 100 the update is the noise's: each step's privatised gradient is mostly N(0, (z C / batch)^2)
    model.load_state_dict({**model.state_dict(), **{n: v.clone() for n, v in start.items()}}, strict=False)
    private_train_round(model, tokenizer, EXAMPLES, cfg, 2e-2, q=4 / 12, noise_multiplier=100.0, clip=1e-3)
    noised = answer_loss(model, tokenizer, EXAMPLES, 4, 64)
    assert noised > after, (noised, after)


def test_the_epsilon_of_a_known_setting_is_the_librarys_documented_value():
    """TensorFlow Privacy's MNIST tutorial: 60,000 records, batches of 256, z = 1.1, 60 epochs, delta 1e-5 is
    documented as epsilon 3.01 (its RDP orders, converted the classic way); dp-accounting's RDP accountant, with its
    tighter conversion, reports less, and no less than the tight PLD accountant's value."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    q, steps = 256 / 60_000, math.ceil(60 * 60_000 / 256)
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(q, 1.1, orders) * steps
    classic = min(r - math.log(1e-5) / (o - 1) for r, o in zip(rdp, orders))
    assert round(classic, 2) == 3.01
    ours = record_epsilon([Steps(q, 1.1, steps)], 1e-5)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.1)), steps
        )
    )
    assert pld.get_epsilon(1e-5) <= ours <= classic
    assert ours == pytest.approx(2.597, abs=0.01)


@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_the_calibrated_noise_spends_the_target_and_one_percent_less_would_not(target):
    q, steps = 4 / 1000, 40
    z = record_noise_for(target, 1e-5, q, steps)
    assert record_epsilon([Steps(q, z, steps)], 1e-5) <= target
    assert record_epsilon([Steps(q, 0.99 * z, steps)], 1e-5) > target
    spent = (Steps(q, z, steps // 2),)  # half the budget's steps already taken: the rest calibrate to the same z
    assert record_noise_for(target, 1e-5, q, steps - steps // 2, spent) == pytest.approx(z, rel=1e-3)
    with pytest.raises(ValueError, match="no noise multiplier"):
        record_noise_for(1e-6, 1e-5, 0.5, 10_000)


def test_a_split_too_small_to_sample_from_is_refused():
    assert sampling_rate(4, 1000) == 0.004
    with pytest.raises(ValueError, match="too small for batches of 4"):
        sampling_rate(4, 4)


def test_the_server_never_loosens_a_members_budget():
    own = effective_budget(2.0, 1e-6, 0.5, 8.0, 0.0, 1e-5, 1.0)
    assert (own.epsilon, own.delta, own.clip_norm, own.source) == (2.0, 1e-6, 0.5, "node")
    capped = effective_budget(20.0, None, None, 8.0, 4.0, 1e-5, 1.0)  # the run's ceiling tightens it
    assert (capped.epsilon, capped.delta, capped.clip_norm) == (4.0, 1e-5, 1.0)
    looser = effective_budget(2.0, 1e-3, None, 8.0, 10.0, 1e-5, 1.0)  # the run asks for more: the member's stays
    assert (looser.epsilon, looser.delta) == (2.0, 1e-5)
    assert effective_budget(None, None, None, 3.0, 0.0, 1e-5, 1.0).source == "run"
    assert effective_budget(None, None, None, 0.0, 0.0, 1e-5, 1.0) is None


def node(state_dir, **node_config) -> Context:
    config = {"partition-id": 1, "state-dir": str(state_dir), **node_config}
    return Context(1, 7, config, RecordDict(), {"run-dir": "r", "strategy": "fedavg"})


@pytest.mark.parametrize(
    "key,value,says",
    [
        ("dp-record-epsilon", "lots", "must be a number > 0"),
        ("dp-record-epsilon", -1.0, "must be a number > 0"),
        ("dp-record-delta", 1.0, "must be a number in (0, 1)"),
        ("dp-record-clip", 0, "must be a number > 0"),
        ("dp-record-epsilon", "12.5e-3x", "must be a number > 0"),
        ("dp-record-noise-multiplier", float("nan"), "must be a number in [0, 1000]"),
    ],
)
def test_a_bad_node_budget_is_refused_naming_its_key_not_its_value(tmp_path, key, value, says):
    with pytest.raises(ValueError) as err:
        record_dp.node_budget(node(tmp_path, **{key: value}), load_run_config({}))
    assert str(err.value) == f"node-config {key}: {says}"  # the member's value stays on its node


def test_a_members_steps_survive_a_restarted_node_and_it_stops_once_its_budget_is_spent(tmp_path):
    cfg = load_run_config({"num-server-rounds": 4, "dp.record-noise-multiplier": 1.2})
    settings = TrainSection(local_steps=20, batch_size=4)
    budget = record_dp.node_budget(node(tmp_path, **{"dp-record-epsilon": 2.0}), cfg)
    spent = 0.0
    for server_round in range(1, 5):
        context = node(tmp_path, **{"dp-record-epsilon": 2.0})  # a fresh SuperNode each round: only its disk
        try:
            plan = record_dp.plan_round(context, cfg, budget, settings, 100, server_round)
        except record_dp.BudgetSpent as err:
            assert "record-level budget spent" in str(err) and server_round > 1
            break
        assert plan.epsilon_after > spent and plan.epsilon_after <= 2.0
        spent = plan.epsilon_after
        member_ledger.count_steps(context, server_round, Steps(plan.q, plan.z, plan.steps))
    else:
        pytest.fail("the member never ran out of its budget")
    assert len(member_ledger.record_steps(node(tmp_path))) == server_round - 1
    # calibrated instead: the planned rounds spend the target, and not more
    calibrated = load_run_config({"num-server-rounds": 4})
    fresh = tmp_path / "fresh"
    for server_round in range(1, 5):
        context = node(fresh)
        plan = record_dp.plan_round(context, calibrated, budget, settings, 100, server_round)
        member_ledger.count_steps(context, server_round, Steps(plan.q, plan.z, plan.steps))
    assert plan.epsilon_after == pytest.approx(2.0, rel=1e-3) and plan.epsilon_after <= 2.0 * (1 + 1e-6)


@pytest.mark.parametrize("strategy", ["simgrad", "atlas", "mira", "vemoe"])
def test_a_strategy_that_computes_from_records_outside_dp_sgd_is_refused_naming_what(strategy):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="dp.record-epsilon: strategy"):
        load_run_config({"strategy": strategy, "dp.record-epsilon": 8.0})
    assert "outside DP-SGD" in (record_dp.refusal(load_run_config({"strategy": strategy})) or "")


@pytest.mark.parametrize("strategy", ["fedavg", "fedavg-dual", "fedsa-lora", "local"])
def test_strategies_whose_updates_are_post_processing_run_with_record_level_dp(strategy):
    cfg = load_run_config({"strategy": strategy, "dp.record-epsilon": 8.0, "dp.record-partition-epsilons": "1,3"})
    assert record_dp.refusal(cfg) is None and cfg.dp.record_default(1) == 3.0 and cfg.dp.record_default(5) == 8.0


def test_a_target_no_noise_can_meet_is_refused_naming_the_key_not_the_value(tmp_path):
    cfg = load_run_config({"num-server-rounds": 4})
    context = node(tmp_path, **{"dp-record-epsilon": 0.001})
    budget = record_dp.node_budget(context, cfg)
    with pytest.raises(ValueError) as err:
        record_dp.plan_round(context, cfg, budget, TrainSection(local_steps=20, batch_size=4), 10, 1)
    assert str(err.value).startswith("node-config dp-record-epsilon: no noise multiplier") and "0.001" not in str(
        err.value
    )
