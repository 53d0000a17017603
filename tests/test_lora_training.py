"""LoRA surgery, adapter I/O and the training loop on a tiny random Llama (seconds, no 4-bit kernels)."""

import numpy as np
import pytest
import torch

from common.adapters import attach_lora, get_adapter_arrays, save_peft_adapter, set_adapter_arrays
from common.adapters.lora import LoraSection
from common.attention import SEGMENT_SDPA, attends_within_examples
from common.config import EvalSection, TrainSection
from common.data import Example
from common.evaluation import answer_loss, evaluate, exact_match, example_losses, losses_and_answers
from common.model import load_base_model, load_tokenizer
from common.training import IGNORE, encode, prompt_ids, round_learning_rate, train_round

EXAMPLES = [Example("toy", f"What is {i} plus {i}?", f"{2 * i}") for i in range(12)]


@pytest.fixture()
def tiny(tiny_llama_dir):
    model = load_base_model(str(tiny_llama_dir), quantization="fp32", device="cpu")
    return attach_lora(model, LoraSection(r=4, alpha=8), seed=0), load_tokenizer(str(tiny_llama_dir))


def test_only_lora_weights_train_and_travel(tiny):
    model, _ = tiny
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    arrays = get_adapter_arrays(model)
    assert list(arrays) == sorted(arrays) and all(a.dtype == np.float32 for a in arrays.values())
    assert sum(a.size for a in arrays.values()) == sum(
        p.numel() for n, p in model.named_parameters() if p.requires_grad
    )


def test_seeded_init_is_identical_across_processes_in_effect(tiny_llama_dir):
    a = get_adapter_arrays(attach_lora(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), LoraSection(r=4), seed=3))
    b = get_adapter_arrays(attach_lora(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), LoraSection(r=4), seed=3))
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_set_arrays_checks_keys_and_shapes(tiny):
    model, _ = tiny
    arrays = get_adapter_arrays(model)
    changed = {k: v + 0.5 for k, v in arrays.items()}
    set_adapter_arrays(model, changed)
    assert all(np.allclose(get_adapter_arrays(model)[k], changed[k]) for k in arrays)
    key = next(iter(arrays))
    with pytest.raises(KeyError):
        set_adapter_arrays(model, {k: v for k, v in arrays.items() if k != key})
    with pytest.raises(ValueError, match="shape"):
        set_adapter_arrays(model, {**arrays, key: np.zeros((1, 1), np.float32)})


def test_unknown_target_module_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="lora.target-modules"):
        attach_lora(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), LoraSection(target_modules=["nope_proj"]))


def test_loss_is_on_answer_tokens_only(tiny):
    _, tokenizer = tiny
    enc = encode(tokenizer, EXAMPLES[3], max_len=64)
    answer = [t for t in enc.labels if t != IGNORE]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "6"
    assert answer[-1] == tokenizer.eos_token_id
    long = encode(tokenizer, Example("t", "word " * 500, "the end"), max_len=40)
    assert (
        len(long.input_ids) == 40
        and tokenizer.decode([t for t in long.labels if t != IGNORE], skip_special_tokens=True) == "the end"
    )


def test_training_lowers_the_loss_and_saved_adapter_reloads(tiny, tiny_llama_dir, tmp_path):
    from peft import PeftModel

    model, tokenizer = tiny
    before = answer_loss(model, tokenizer, EXAMPLES, 4, 64)
    metrics = train_round(
        model, tokenizer, EXAMPLES, TrainSection(local_steps=15, batch_size=4, learning_rate=5e-3), lr=5e-3, seed=0
    )
    after = answer_loss(model, tokenizer, EXAMPLES, 4, 64)
    assert after < before - 0.1, (before, after)
    assert metrics["train_examples"] == 60 and metrics["train_tokens"] > 0
    # the useful tokens: every answer token of the 60 examples drawn (5 passes over the 12), and no prompt token
    answers = sum(int((torch.tensor(encode(tokenizer, e, 2048).labels) != IGNORE).sum()) for e in EXAMPLES)
    assert metrics["train_loss_tokens"] == 5 * answers < metrics["train_tokens"]
    assert metrics["loss_tokens_per_second"] == pytest.approx(metrics["train_loss_tokens"] / metrics["train_seconds"])
    assert "gpu_peak_allocated_mb" not in metrics  # a CPU run reports no GPU memory

    arrays = get_adapter_arrays(model)
    train_round(model, tokenizer, EXAMPLES, TrainSection(local_steps=2, batch_size=4), lr=5e-3, seed=1)
    # what was read is a copy: it must not follow the live weights (a client's "initial" adapter once did, so the
    # next local-only client in the same process started from the previous client's training)
    assert any(np.abs(arrays[k] - v).max() > 0 for k, v in get_adapter_arrays(model).items())
    set_adapter_arrays(model, arrays)
    out = save_peft_adapter(arrays, LoraSection(r=4, alpha=8), str(tiny_llama_dir), tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_base_model(str(tiny_llama_dir), "fp32", "cpu"), str(out))
    ids = torch.tensor([encode(tokenizer, EXAMPLES[0], 64).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_evaluate_reports_all_metrics(tiny):
    model, tokenizer = tiny
    metrics = evaluate(
        model,
        tokenizer,
        EXAMPLES,
        EvalSection(max_examples=4, batch_size=2, max_new_tokens=3),
        TrainSection(max_seq_len=64),
    )
    assert metrics["eval_examples"] == 4
    assert metrics["perplexity"] == pytest.approx(np.exp(metrics["eval_loss"]))
    assert 0 <= metrics["exact_match"] <= 1 and 0 <= metrics["rouge_l"] <= 1


def test_per_example_losses_make_the_loss_and_generation_runs_on_a_subset(tiny):
    """The held-out loss is the token-weighted mean of the per-example losses a comparison bootstraps over, the same
    whatever the batching (length-sorted batches, packed in one row or padded), and only ``generate-examples`` are
    generated."""
    model, tokenizer = tiny
    examples = [Example("toy", "Say a long thing " * (i % 5), "word " * (1 + i % 4)) for i in range(10)]
    cfg = EvalSection(max_examples=4, final_examples=10, generate_examples=3, batch_size=3, max_new_tokens=2)
    metrics = evaluate(model, tokenizer, examples, cfg, TrainSection(max_seq_len=64), max_examples=10)
    losses, tokens = np.array(metrics["eval_example_loss"]), np.array(metrics["eval_example_tokens"])
    assert metrics["eval_examples"] == len(losses) == len(tokens) == 10 and metrics["eval_generated"] == 3
    assert metrics["eval_loss"] == pytest.approx((losses * tokens).sum() / tokens.sum(), rel=1e-6)
    for i in (0, 7):  # each example alone gives its own loss: the order of the batches changed nothing
        assert answer_loss(model, tokenizer, [examples[i]], 1, 64) == pytest.approx(losses[i], rel=1e-4)
    assert answer_loss(model, tokenizer, examples, 10, 64) == pytest.approx(metrics["eval_loss"], rel=1e-4)
    packed, padded = (example_losses(model, tokenizer, examples, 3, 64, packed=p) for p in (True, False))
    assert [n for _, n in packed] == [n for _, n in padded] == list(tokens)  # one padding-free row per batch
    assert np.allclose([s for s, _ in packed], [s for s, _ in padded], rtol=1e-5)
    assert cfg.examples_at(0, 3) == cfg.examples_at(3, 3) == 10 and cfg.examples_at(1, 3) == 4
    assert EvalSection(max_examples=4).examples_at(3, 3) == 4  # final-examples 0: the same everywhere


@pytest.mark.parametrize("attention", [SEGMENT_SDPA, "sdpa"])
def test_loss_and_generation_from_one_prompt_encoding_equal_the_separate_passes(tiny, attention):
    """Evaluation encodes a generated example's prompt once, for its loss and its answer: the per-example losses
    equal the plain loss pass's and the greedy answers equal generating from each prompt alone, with prompts and
    answers of different lengths in one batch and a conversation of several turns (its earlier answer is in the
    loss, the last one is generated). Both layouts of the shared pass: one packed row (the base model's attention,
    each example attending to itself) and a padded batch (any other attention: transformers' packed-row mask is not
    built while a cache is filled)."""
    model, tokenizer = tiny
    model.set_attn_implementation(attention)
    assert attends_within_examples(model) == (attention == SEGMENT_SDPA)
    torch.manual_seed(1)
    with torch.no_grad():  # B != 0, so the adapter takes part in both passes
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    examples = [Example("toy", "Say a long thing " * (i % 5), "word " * (1 + i % 4)) for i in range(6)]
    turns = (
        ("system", "Be short."),
        ("user", "One?"),
        ("assistant", "one two"),
        ("user", "Two?"),
        ("assistant", "two"),
    )
    examples.append(Example("toy", "Two?", "two", turns))
    model.eval()
    losses, answers, _ = losses_and_answers(model, tokenizer, examples, 3, 96, max_new_tokens=4)
    reference = example_losses(model, tokenizer, examples, 3, 96)
    assert [n for _, n in losses] == [n for _, n in reference] and reference[-1][1] > len(_ids_of(tokenizer, "two"))
    assert np.allclose([s for s, _ in losses], [s for s, _ in reference], rtol=1e-5)
    for example, answer in zip(examples, answers):
        prompt = torch.tensor([prompt_ids(tokenizer, example)])
        alone = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert answer == tokenizer.decode(alone[0, prompt.shape[1] :], skip_special_tokens=True).strip()


def _ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_exact_match_normalisation_and_lr_schedule():
    assert exact_match("The answer: Paris.\nmore text", "answer paris") == 1.0
    assert exact_match("9 apples", "8 apples") == 0.0
    cfg = TrainSection(learning_rate=1e-3, min_lr_ratio=0.1)
    assert round_learning_rate(cfg, 1, 5) == pytest.approx(1e-3)
    assert round_learning_rate(cfg, 5, 5) == pytest.approx(1e-4)
    assert round_learning_rate(cfg, 1, 5) > round_learning_rate(cfg, 3, 5) > round_learning_rate(cfg, 5, 5)


@pytest.mark.parametrize("micro", [1, 3])
def test_micro_batches_give_the_whole_batch_gradient(tiny, micro):
    """A node with less memory (node-config max-micro-batch) makes the same update, in more passes."""
    from common.training import accumulate_batch, collate

    model, tokenizer = tiny
    for p in model.parameters():
        if p.requires_grad and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)  # lora_B starts at zero: give every LoRA weight a gradient
    batch = [encode(tokenizer, EXAMPLES[i], 64) for i in (0, 5, 6, 11, 3)]  # answers of 1 and 2 digits
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(micro_batch_size):
        model.zero_grad(set_to_none=True)
        cfg = TrainSection(batch_size=5, grad_accum_steps=2, micro_batch_size=micro_batch_size)
        loss = accumulate_batch(model, batch, tokenizer.pad_token_id, cfg, "cpu")
        return loss, [p.grad.clone() for p in params]

    whole_loss, whole = gradient(0)
    sliced_loss, sliced = gradient(micro)
    reference = model(**collate(batch, tokenizer.pad_token_id)).loss.item() / 2
    assert whole_loss == pytest.approx(reference, rel=1e-5) and sliced_loss == pytest.approx(reference, rel=1e-5)
    for a, b in zip(whole, sliced):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    assert any(g.abs().max() > 0 for g in whole)


def test_node_memory_budget_caps_the_micro_batch():
    from client_app.handlers import node_train_settings

    settings = TrainSection(batch_size=4)
    assert node_train_settings(settings, {}).micro_batch_size == 0
    assert node_train_settings(settings, {"max-micro-batch": 1}).micro_batch_size == 1
    assert node_train_settings(settings, {"max-micro-batch": 16}).micro_batch_size == 4
    with pytest.raises(ValueError, match="max-micro-batch"):
        node_train_settings(settings, {"max-micro-batch": 0})


def test_learning_rate_groups_must_cover_every_trainable_parameter_once(tiny):
    model, tokenizer = tiny
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = TrainSection(local_steps=1, batch_size=2)
    with pytest.raises(ValueError, match="lr_groups"):
        train_round(model, tokenizer, EXAMPLES, cfg, lr=1e-3, seed=0, lr_groups=[(params[1:], 1.0)])
    with pytest.raises(ValueError, match="lr_groups"):
        train_round(model, tokenizer, EXAMPLES, cfg, lr=1e-3, seed=0, lr_groups=[(params, 1.0), (params[:1], 2.0)])
    frozen = {k: v.copy() for k, v in get_adapter_arrays(model).items()}
    train_round(model, tokenizer, EXAMPLES, cfg, lr=1e-2, seed=0, lr_groups=[(params, 0.0)])  # a rate of 0: no step
    assert all(np.array_equal(frozen[k], v) for k, v in get_adapter_arrays(model).items())


@pytest.mark.parametrize("micro", [0, 2])
def test_a_packed_batch_gives_the_padded_batchs_loss_and_gradients(tiny, micro):
    """train.packing: the batch in one row, positions restarting per example, no padding; the same loss and LoRA
    gradients as the padded batch (whole or in micro-batches). Read as one sequence (positions running on), the same
    row would attend across examples and give another loss: the positions are what keep the examples apart."""
    from common.training import accumulate_batch, pack

    model, tokenizer = tiny
    for p in model.parameters():
        if p.requires_grad and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)  # lora_B starts at zero: give every LoRA weight a gradient
    varied = [Example("toy", "Add these numbers: " + " plus ".join(["7"] * k) + "?", str(7 * k)) for k in (1, 9, 3, 14)]
    batch = [encode(tokenizer, e, 128) for e in varied]
    assert len({len(e.input_ids) for e in batch}) == 4  # the padded batch pads three of them
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(packing: bool):
        model.zero_grad(set_to_none=True)
        cfg = TrainSection(batch_size=4, micro_batch_size=micro, packing=packing)
        loss = accumulate_batch(model, batch, tokenizer.pad_token_id, cfg, "cpu")
        return loss, [p.grad.clone() for p in params]

    padded_loss, padded = gradient(False)
    packed_loss, packed = gradient(True)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    for a, b in zip(padded, packed):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    row = pack(batch)
    with torch.no_grad():
        as_one = model(input_ids=row["input_ids"], labels=row["labels"]).loss.item()  # positions 0..T-1
    assert abs(as_one - padded_loss) > 20 * abs(packed_loss - padded_loss) + 1e-4, (as_one, packed_loss, padded_loss)


@pytest.mark.parametrize("packing", [False, True])
def test_the_lm_head_at_labelled_positions_only_gives_the_full_logits_loss_and_gradients(tiny, packing):
    """train.loss-logits="labelled" (the default): the vocabulary-wide logits only where a labelled token is
    predicted, padded or packed, whole or in micro-batches: the loss and LoRA gradients of "all" (transformers' own
    loss over every position's logits). The logits it computes are those of the answer positions only."""
    from common.training import accumulate_batch, collate, labelled_loss, loss_positions, pack

    model, tokenizer = tiny
    for p in model.parameters():
        if p.requires_grad and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)  # lora_B starts at zero: give every LoRA weight a gradient
    batch = [encode(tokenizer, EXAMPLES[i], 64) for i in (0, 5, 6, 11, 3)]
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(where: str, micro: int):
        model.zero_grad(set_to_none=True)
        cfg = TrainSection(batch_size=5, micro_batch_size=micro, packing=packing, loss_logits=where)
        loss = accumulate_batch(model, batch, tokenizer.pad_token_id, cfg, "cpu")
        return loss, [p.grad.clone() for p in params]

    full_loss, full = gradient("all", 0)
    for micro in (0, 2):
        loss, grads = gradient("labelled", micro)
        assert loss == pytest.approx(full_loss, rel=1e-5)
        for a, b in zip(full, grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert any(g.abs().max() > 0 for g in full)
    inputs = pack(batch) if packing else collate(batch, tokenizer.pad_token_id)
    keep = loss_positions(inputs["labels"])
    answers = sum(int((torch.tensor(e.labels[1:]) != IGNORE).sum()) for e in batch)
    assert int(keep.sum()) == answers < inputs["labels"].numel() // 3  # the prompts' positions are skipped
    with torch.no_grad():
        assert float(labelled_loss(model, inputs)) == pytest.approx(float(model(**inputs).loss), rel=1e-5)


def test_linear_cross_entropy_by_chunks_equals_autograd_for_every_input():
    """The fused chunked loss (a plain lm_head): its summed loss and the gradients of the hidden states, the weight
    and the bias equal autograd's through the whole logits, whatever the chunk."""
    from common.chunked_loss import LinearCrossEntropy

    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(13, 8), torch.randn(50, 8) * 0.3, torch.randn(50) * 0.1
    targets = torch.randint(0, 50, (13,))
    scale = 1 / 13
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    (
        torch.nn.functional.cross_entropy(torch.nn.functional.linear(*leaves), targets, reduction="sum") * scale
    ).backward()
    for chunk in (1, 4, 13, 100):
        mine = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = LinearCrossEntropy.apply(*mine, targets, chunk)
        (loss * scale).backward()
        reference = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(hidden, weight, bias), targets, reduction="sum"
        )
        torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-5)
        for a, b in zip(leaves, mine):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("head_lora", [False, True])
def test_a_chunked_lm_head_gives_the_same_loss_and_gradients(tiny_llama_dir, packing, head_lora, monkeypatch):
    """train.loss-chunk-tokens: a micro-batch with more answer tokens than a chunk takes the lm_head and the
    cross-entropy a chunk at a time: the loss and gradients of the logits at once, by the fused loss (a plain
    lm_head) or by recomputation (a LoRA on the lm_head, whose gradient only comes through it). The output
    embedding's own forward is back afterwards; a batch within one chunk takes the plain path."""
    import common.chunked_loss as chunked_loss
    from common.training import accumulate_batch

    targets = "q_proj,v_proj,lm_head" if head_lora else "q_proj,v_proj"
    base = load_base_model(str(tiny_llama_dir), quantization="fp32", device="cpu")
    model = attach_lora(base, LoraSection(r=4, alpha=8, target_modules=targets), seed=0)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    torch.manual_seed(0)
    for p in model.parameters():
        if p.requires_grad and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lm_head" in n for n in names) == head_lora
    assert (type(model.get_output_embeddings()) is torch.nn.Linear) != head_lora  # fused / recomputed
    batch = [encode(tokenizer, EXAMPLES[i], 64) for i in (0, 5, 6, 11, 3)]
    calls = {"n": 0}
    real = chunked_loss.chunked_cross_entropy

    def counted(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(chunked_loss, "chunked_cross_entropy", counted)

    def gradient(chunk: int, micro: int):
        model.zero_grad(set_to_none=True)
        cfg = TrainSection(batch_size=5, micro_batch_size=micro, packing=packing, loss_chunk_tokens=chunk)
        loss = accumulate_batch(model, batch, tokenizer.pad_token_id, cfg, "cpu")
        return loss, [p.grad.clone() for p in model.parameters() if p.requires_grad]

    whole_loss, whole = gradient(0, 0)
    assert calls["n"] == 0 and all(g.abs().max() > 0 for g in whole)
    answers = [sum(label != IGNORE for label in e.labels[1:]) for e in batch]
    expected = 0
    for chunk, micro in ((1, 0), (7, 0), (2, 2)):
        loss, grads = gradient(chunk, micro)
        assert loss == pytest.approx(whole_loss, rel=1e-5)
        for name, a, b in zip(names, whole, grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
        pieces = [answers[i : i + (micro or len(batch))] for i in range(0, len(batch), micro or len(batch))]
        expected += sum(sum(piece) > chunk for piece in pieces)
    assert calls["n"] == expected >= 4  # every micro-batch with more answer tokens than a chunk, and only those
    assert "forward" not in model.get_output_embeddings().__dict__
    gradient(10_000, 0)
    assert calls["n"] == expected  # within one chunk: the logits at once


@pytest.mark.parametrize("quantization", ["fp32", "nf4"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_llama_dir, quantization):
    """model.gradient-checkpointing: activations recomputed in the backward pass, the same training step."""
    from common.training import accumulate_batch

    def step(checkpointing: bool):
        base = load_base_model(str(tiny_llama_dir), quantization, "cpu", gradient_checkpointing=checkpointing)
        assert base.is_activation_checkpointing == checkpointing
        model, tokenizer = attach_lora(base, LoraSection(r=4, alpha=8), seed=0), load_tokenizer(str(tiny_llama_dir))
        torch.manual_seed(1)
        for p in model.parameters():
            if p.requires_grad and p.dim() == 2:
                torch.nn.init.normal_(p, std=0.05)
        model.train()
        batch = [encode(tokenizer, EXAMPLES[i], 64) for i in (0, 5, 11)]
        loss = accumulate_batch(model, batch, tokenizer.pad_token_id, TrainSection(batch_size=3), "cpu")
        return loss, [p.grad.clone() for p in model.parameters() if p.requires_grad]

    loss, grads = step(False)
    recomputed_loss, recomputed = step(True)
    assert recomputed_loss == pytest.approx(loss, rel=1e-5) and any(g.abs().max() > 0 for g in grads)
    for a, b in zip(grads, recomputed):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
