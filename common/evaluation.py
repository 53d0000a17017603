"""Evaluation on a client's held-out split: answer-token loss / perplexity, exact match and ROUGE-L.

Loss is computed on the same chat-formatted examples as training, batched by length (one forward per batch, no
generation), and reported per example too (mean loss per answer token and the token count), so that a comparison can
bootstrap over held-out examples. Exact match and ROUGE-L (rouge-score, F1) come from batched greedy generation with
left padding on a subset (``eval.generate-examples``): generation costs a decode per token, the loss does not.
"""

from __future__ import annotations

import math
import re
import string
import time

import torch

from .config import EvalSection, TrainSection
from .data import Example
from .training import collate, encode, labelled_logits, prompt_ids

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise(text: str) -> str:
    """SQuAD-style normalisation: first line, lower case, no punctuation, no articles, single spaces."""
    text = text.strip().split("\n")[0].lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalise(prediction) == normalise(reference))


def _answer_logits(model, tokenizer, examples: list[Example], batch_size: int, max_len: int):
    """Per batch (in order of length, so a batch pads to similar lengths): the examples' indices, the logits at
    the positions that predict an answer token (answer tokens in the batch, vocabulary), those tokens, and each
    logit row's row in the batch."""
    device = next(model.parameters()).device
    encoded = [encode(tokenizer, e, max_len) for e in examples]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = collate([encoded[i] for i in chunk], tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        # Logits only where an answer token is predicted (position t predicts token t + 1): the lm_head over the
        # whole vocabulary at every prompt position would be a fifth of the forward's work for nothing.
        logits, targets, keep = labelled_logits(model, batch)
        yield chunk, logits.float(), targets, keep.nonzero()[:, 0]


def _per_row(values: torch.Tensor, rows: torch.Tensor, n: int) -> list[float]:
    """Sums of ``values`` per batch row."""
    return torch.zeros(n, dtype=torch.float64, device=rows.device).index_add_(0, rows, values.double()).tolist()


@torch.no_grad()
def example_losses(model, tokenizer, examples: list[Example], batch_size: int, max_len: int) -> list[tuple[float, int]]:
    """Per example, in the given order: (summed cross-entropy over its answer tokens, number of answer tokens)."""
    out: list[tuple[float, int]] = [(0.0, 0)] * len(examples)
    for chunk, logits, targets, rows in _answer_logits(model, tokenizer, examples, batch_size, max_len):
        token_losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        sums, counts = (
            _per_row(token_losses, rows, len(chunk)),
            _per_row(torch.ones_like(token_losses), rows, len(chunk)),
        )
        for row, i in enumerate(chunk):
            out[i] = (sums[row], int(counts[row]))
    return out


@torch.no_grad()
def example_token_stats(
    model, tokenizer, examples: list[Example], batch_size: int, max_len: int, smoothing: float
) -> list[tuple[float, int, int]]:
    """Per example, in the given order: (summed log-loss in bits of the prediction smoothed with the uniform
    distribution, (1 - smoothing) p + smoothing / V, over its answer tokens; top-1 errors; answer tokens). The
    smoothing bounds a token's loss by log2(V / smoothing) bits (what a generalisation bound needs)."""
    out: list[tuple[float, int, int]] = [(0.0, 0, 0)] * len(examples)
    for chunk, logits, targets, rows in _answer_logits(model, tokenizer, examples, batch_size, max_len):
        p = torch.softmax(logits.double(), dim=-1).gather(1, targets[:, None])[:, 0]
        bits = -torch.log2((1 - smoothing) * p + smoothing / logits.shape[-1])
        errors = (logits.argmax(dim=-1) != targets).double()
        n = len(chunk)
        sums, wrong, counts = (
            _per_row(bits, rows, n),
            _per_row(errors, rows, n),
            _per_row(torch.ones_like(bits), rows, n),
        )
        for row, i in enumerate(chunk):
            out[i] = (sums[row], int(wrong[row]), int(counts[row]))
    return out


def token_mean(per_example: list[tuple[float, int]]) -> float:
    """Mean cross-entropy per answer token over (summed loss, token count) pairs."""
    return sum(s for s, _ in per_example) / max(sum(n for _, n in per_example), 1)


def answer_loss(model, tokenizer, examples: list[Example], batch_size: int, max_len: int) -> float:
    """Mean cross-entropy per answer token over the examples."""
    return token_mean(example_losses(model, tokenizer, examples, batch_size, max_len))


@torch.no_grad()
def generate_answers(
    model, tokenizer, examples: list[Example], batch_size: int, max_new_tokens: int, max_len: int
) -> list[str]:
    device = next(model.parameters()).device
    answers: list[str] = []
    for i in range(0, len(examples), batch_size):
        prompts = [prompt_ids(tokenizer, e)[-(max_len - max_new_tokens) :] for e in examples[i : i + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding, so every row continues from its last prompt token
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
        )
        answers.extend(tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out)
    return answers


def evaluate(
    model,
    tokenizer,
    examples: list[Example],
    cfg: EvalSection,
    train_cfg: TrainSection,
    max_examples: int | None = None,
) -> dict[str, float | int | list[float] | list[int]]:
    """Loss on the first ``max_examples`` (default ``eval.max-examples``) held-out examples, generation on the first
    ``eval.generate-examples`` of those. ``eval_example_loss`` / ``eval_example_tokens`` are the per-example mean loss
    per answer token and token counts (``eval_loss`` is their token-weighted mean); EM and ROUGE-L are over the
    ``eval_generated`` examples generated."""
    from rouge_score import rouge_scorer

    start = time.perf_counter()
    examples = examples[: max_examples or cfg.max_examples]
    model.eval()
    per_example = example_losses(model, tokenizer, examples, cfg.batch_size, train_cfg.max_seq_len)
    loss = token_mean(per_example)
    loss_seconds = time.perf_counter() - start
    generated = examples[: cfg.generate_examples]
    predictions = generate_answers(
        model, tokenizer, generated, cfg.batch_size, cfg.max_new_tokens, train_cfg.max_seq_len
    )
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    em = [exact_match(p, e.answer) for p, e in zip(predictions, generated)]
    rouge = [scorer.score(e.answer, p)["rougeL"].fmeasure for p, e in zip(predictions, generated)]
    return {
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "exact_match": sum(em) / len(em),
        "rouge_l": sum(rouge) / len(rouge),
        "eval_examples": len(examples),
        "eval_generated": len(generated),
        "eval_example_loss": [s / max(n, 1) for s, n in per_example],
        "eval_example_tokens": [n for _, n in per_example],
        "eval_loss_seconds": loss_seconds,
        "eval_seconds": time.perf_counter() - start,
    }
