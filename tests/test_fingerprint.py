"""Task fingerprints on a tiny random Llama: the last blocks' LoRA gradients, per-layer normalised and sketched;
examples of one task give nearby fingerprints, examples of another a distant one."""

import numpy as np
import pytest

from common.adapters.lora import LoraSection
from common.adapters.lora.model import attach_lora, get_adapter_arrays
from common.data import Example
from common.model import load_base_model, load_tokenizer
from strategies.fingerprint.client import fingerprint_batches
from strategies.fingerprint.gradients import AdapterGradients, adapter_gradients, layer_name, layer_normalised, sketch

ARITHMETIC = [Example("math", f"What is {a} plus {b}?", str(a + b)) for a in range(1, 9) for b in range(1, 4)]
YES_NO = [
    Example("yesno", f"Is the sky {c} today?", "yes" if i % 2 else "no")
    for i, c in enumerate(["blue", "green", "grey", "red", "white", "dark", "clear", "pink"] * 3)
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model = attach_lora(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), LoraSection(r=4, alpha=8), seed=0)
    return model, load_tokenizer(str(tiny_llama_dir))


def fingerprint(tiny, examples, seed):
    model, tokenizer = tiny
    grads = adapter_gradients(model, tokenizer, fingerprint_batches(examples, 6, 4, seed), 64)
    assert grads.batches == 6
    return sketch(layer_normalised(grads.gradients, grads.last_blocks(2)), 256, seed=0), grads


def test_gradients_are_per_layer_and_change_no_weight(tiny):
    model, _ = tiny
    before = get_adapter_arrays(model)
    _, grads = fingerprint(tiny, ARITHMETIC, 1)
    gradients = grads.gradients
    after = get_adapter_arrays(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    num_blocks = len(set(grads.block_of.values()))
    assert sorted(gradients) == sorted(
        f"model.layers.{b}.self_attn.{m}" for b in range(num_blocks) for m in ("q_proj", "v_proj")
    )
    assert grads.last_blocks(2) == sorted(n for n, b in grads.block_of.items() if b >= num_blocks - 2)
    assert all(np.linalg.norm(g) > 0 for g in gradients.values())  # B's gradient (A's is 0 while B is 0)


def test_same_task_fingerprints_are_closer_than_other_task_ones(tiny):
    math_a, _ = fingerprint(tiny, ARITHMETIC[::2], 1)
    math_b, _ = fingerprint(tiny, ARITHMETIC[1::2], 2)
    yes_no, _ = fingerprint(tiny, YES_NO, 3)
    same = np.linalg.norm(math_a - math_b)
    assert same < np.linalg.norm(math_a - yes_no) and same < np.linalg.norm(math_b - yes_no)


def test_layer_normalisation_and_sketch():
    grads = {"block0.q": np.array([3.0, 4.0]), "block1.q": np.array([0.0, 0.0]), "block1.v": np.array([2.0])}
    np.testing.assert_allclose(layer_normalised(grads, ["block0.q", "block1.q", "block1.v"]), [0.6, 0.8, 0, 0, 1])
    x = np.random.default_rng(0).normal(size=5000)
    y = x + 0.1 * np.random.default_rng(1).normal(size=5000)
    sx, sy = sketch(x, 512, seed=4), sketch(y, 512, seed=4)
    assert np.array_equal(sx, sketch(x, 512, seed=4))  # shared seed: the same sketch on every client
    assert np.dot(sx, sy) == pytest.approx(np.dot(x, y), rel=0.2)  # inner products kept in expectation


def test_layer_names_from_peft_parameters():
    name = "base_model.model.model.layers.29.self_attn.q_proj.lora_B.default.weight"
    assert layer_name(name) == "model.layers.29.self_attn.q_proj"
    assert layer_name("base_model.model.lm_head.lora_A.default.weight") == "lm_head"
    grads = AdapterGradients({}, {"a": 0, "b": 1, "c": 2, "head": None}, 1)
    assert grads.last_blocks(2) == ["b", "c", "head"]
