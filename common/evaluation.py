"""Evaluation on a client's held-out split: answer-token loss / perplexity, exact match and ROUGE-L.

Loss is computed on the same chat-formatted examples as training, batched by length, and reported per example too
(mean loss per answer token and the token count), so that a comparison can bootstrap over held-out examples. Exact
match and ROUGE-L (rouge-score, F1) come from batched greedy generation (key/value cache, stopping when every row
has ended) on a subset (``eval.generate-examples``). A generated example's prompt is encoded ONCE: its loss and its
answer share the prompt's forward pass and cache (``losses_and_answers``); the rest get the loss only.
"""

from __future__ import annotations

import math
import re
import string
import time
from typing import Any

import torch
from transformers import DynamicCache

from .attention import attends_within_examples
from .config import EvalSection, TrainSection
from .data import Example
from .training import IGNORE, Encoded, collate, encode, labelled_forward, pack, to_device

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise(text: str) -> str:
    """SQuAD-style normalisation: first line, lower case, no punctuation, no articles, single spaces."""
    text = text.strip().split("\n")[0].lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalise(prediction) == normalise(reference))


def _batches_by_length(encoded: list[Encoded], batch_size: int):
    """The examples' indices in batches, in order of length (so that a padded batch pads to similar lengths)."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def _scored(model, rows: list[Encoded], pad_id: int, packed: bool, **forward):
    """One batch's forward with logits only where an answer token is predicted (position t predicts token t + 1):
    the lm_head over the whole vocabulary at every prompt position would be a fifth of the forward's work for
    nothing. Returns the model's output (``forward`` passed on, e.g. ``use_cache``), the batch, those logits (answer
    tokens in the batch, vocabulary), the tokens, and each logit row's example in the batch. ``packed``: the batch as
    one padding-free row (``pack``; each example attends to itself only), else padded (``collate``): the same
    logits to float rounding."""
    device = next(model.parameters()).device
    batch = pack(rows) if packed else collate(rows, pad_id)
    batch = to_device(batch, device)
    out, targets, keep = labelled_forward(model, batch, **forward)
    where = keep.nonzero()
    if packed:  # the example a position of the row belongs to, from the examples' bounds
        example = torch.searchsorted(batch["cu_seq_lens_q"][1:].to(where), where[:, 1], right=True)
    else:
        example = where[:, 0]
    return out, batch, out.logits.float(), targets, example


def _answer_logits(model, tokenizer, examples: list[Example], batch_size: int, max_len: int, packed: bool = True):
    """Per batch (``_batches_by_length``): the examples' indices and ``_scored``'s logits, tokens and examples."""
    encoded = [encode(tokenizer, e, max_len) for e in examples]
    for chunk in _batches_by_length(encoded, batch_size):
        _, _, logits, targets, example = _scored(model, [encoded[i] for i in chunk], tokenizer.pad_token_id, packed)
        yield chunk, logits, targets, example


def _per_row(values: torch.Tensor, rows: torch.Tensor, n: int) -> list[float]:
    """Sums of ``values`` per batch row."""
    return torch.zeros(n, dtype=torch.float64, device=rows.device).index_add_(0, rows, values.double()).tolist()


def _losses_per_row(token_losses: torch.Tensor, rows: torch.Tensor, n: int) -> list[tuple[float, int]]:
    """Per batch row: (summed loss of its tokens, how many), from the tokens' losses and each token's row."""
    sums, counts = _per_row(token_losses, rows, n), _per_row(torch.ones_like(token_losses), rows, n)
    return [(total, int(count)) for total, count in zip(sums, counts)]


@torch.no_grad()
def example_losses(
    model, tokenizer, examples: list[Example], batch_size: int, max_len: int, packed: bool = True
) -> list[tuple[float, int]]:
    """Per example, in the given order: (summed cross-entropy over its answer tokens, number of answer tokens).
    ``packed``: a batch's examples in one padding-free row (the default), else padded; the same to float rounding."""
    out: list[tuple[float, int]] = [(0.0, 0)] * len(examples)
    for chunk, logits, targets, rows in _answer_logits(model, tokenizer, examples, batch_size, max_len, packed):
        token_losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        for i, summed in zip(chunk, _losses_per_row(token_losses, rows, len(chunk))):
            out[i] = summed
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


def _last_answer_start(example: Encoded) -> int:
    """Where an encoded conversation's last assistant turn begins: what precedes it is the generation prompt."""
    start = len(example.labels)
    while start > 1 and example.labels[start - 1] != IGNORE:
        start -= 1
    return start


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths ending in one column (what batched generation continues): ids and mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p, dtype=torch.long), 1
    return ids, mask


def _prompt_cache(model, cache: Any, sources: list[tuple[int, int]], lengths: list[int], width: int) -> DynamicCache:
    """A key/value cache cut back to each example's prompt and laid out as a left-padded batch: example i's
    ``lengths[i]`` tokens, from row ``sources[i][0]`` of ``cache`` at column ``sources[i][1]`` on, in the last
    columns of its row of ``width``. Each example's keys were computed at its own positions, attending to itself
    only (a packed row's examples from their bounds, a padded row from column 0), so they are the keys of that
    prompt encoded alone; the padding columns are zeros that the attention mask hides."""
    device = cache.layers[0].keys.device
    rows = torch.tensor([row for row, _ in sources], dtype=torch.long)[:, None]
    columns = torch.zeros(len(sources), width, dtype=torch.long)
    filled = torch.zeros(len(sources), width, dtype=torch.bool)
    for example, ((_, start), n) in enumerate(zip(sources, lengths)):
        columns[example, width - n :] = torch.arange(start, start + n)
        filled[example, width - n :] = True
    rows, columns, hidden = rows.to(device), columns.to(device), (~filled).to(device)[:, None, :, None]
    prompts = DynamicCache(config=model.config)
    for number, layer in enumerate(cache.layers):
        # (rows, heads, length, head dim) -> (examples, width, heads, head dim) -> (examples, heads, width, head dim)
        keys, values = (t.transpose(1, 2)[rows, columns].transpose(1, 2) for t in (layer.keys, layer.values))
        prompts.update(keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0), number)
    return prompts


@torch.no_grad()
def losses_and_answers(
    model,
    tokenizer,
    examples: list[Example],
    batch_size: int,
    max_len: int,
    max_new_tokens: int,
    packed: bool = True,
) -> tuple[list[tuple[float, int]], list[str], float]:
    """``example_losses`` and greedy answers to the examples' last turns from ONE encoding of each prompt: per
    batch, the loss pass of ``example_losses`` (the whole conversations, packed in one padding-free row where the
    model's attention keeps examples apart with a cache, else padded), keeping its key/value cache; then generation
    continues each example from that cache cut back to its prompt and laid out as a left-padded batch
    (``_prompt_cache``). ``packed=False`` (``train.packing`` off) pads every batch. The prompt is the conversation as
    the loss sees it (``encode``'s cut to ``max_len``). Returns the losses, the answers (both in the given order) and
    the seconds the loss took."""
    encoded = [encode(tokenizer, e, max_len) for e in examples]
    losses: list[tuple[float, int]] = [(0.0, 0)] * len(examples)
    answers = [""] * len(examples)
    loss_seconds = 0.0
    pad_id = tokenizer.pad_token_id
    # One padding-free row per batch where each example attends to itself only even while filling a cache;
    # otherwise a padded batch (the same losses and keys to float rounding).
    packed = packed and attends_within_examples(model)
    for chunk in _batches_by_length(encoded, batch_size):
        began = time.perf_counter()
        rows = [encoded[i] for i in chunk]
        out, batch, logits, targets, example = _scored(model, rows, pad_id, packed, use_cache=True)
        token_losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        per_row = _losses_per_row(token_losses, example, len(chunk))
        loss_seconds += time.perf_counter() - began
        prompts = [e.input_ids[: _last_answer_start(e)] for e in rows]
        ids, mask = left_padded(prompts, pad_id)
        # where each example's cache begins: (row, column) of the packed row, or its own padded row
        sources = [(0, int(a)) for a in batch["cu_seq_lens_q"][:-1]] if packed else [(r, 0) for r in range(len(rows))]
        # generate() runs each prompt's last token itself (it needs one uncached input): the cache holds the rest
        cache = _prompt_cache(model, out.cache, sources, [len(p) - 1 for p in prompts], ids.shape[1] - 1)
        generated = model.generate(
            input_ids=ids.to(logits.device),
            attention_mask=mask.to(logits.device),
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
        )
        for row, i in enumerate(chunk):
            losses[i] = per_row[row]
            answers[i] = tokenizer.decode(generated[row, ids.shape[1] :], skip_special_tokens=True).strip()
    return losses, answers, loss_seconds


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
    generated = examples[: cfg.generate_examples]
    # The generated examples' prompts are encoded once for their loss and their answers; the rest only for the loss.
    first, predictions, loss_seconds = losses_and_answers(
        model, tokenizer, generated, cfg.batch_size, train_cfg.max_seq_len, cfg.max_new_tokens, train_cfg.packing
    )
    rest_start = time.perf_counter()
    per_example = first + example_losses(
        model, tokenizer, examples[len(generated) :], cfg.batch_size, train_cfg.max_seq_len, train_cfg.packing
    )
    loss_seconds += time.perf_counter() - rest_start
    loss = token_mean(per_example)
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
