"""Evaluation on a client's held-out split: answer-token loss / perplexity, exact match and ROUGE-L.

Loss is computed on the same chat-formatted examples as training; exact match and ROUGE-L (rouge-score, F1)
come from batched greedy generation with left padding.
"""

from __future__ import annotations

import math
import re
import string
import time

import torch

from .config import EvalSection, TrainSection
from .data import Example
from .training import collate, encode, prompt_ids

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise(text: str) -> str:
    """SQuAD-style normalisation: first line, lower case, no punctuation, no articles, single spaces."""
    text = text.strip().split("\n")[0].lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalise(prediction) == normalise(reference))


@torch.no_grad()
def answer_loss(model, tokenizer, examples: list[Example], batch_size: int, max_len: int) -> float:
    """Mean cross-entropy per answer token over the examples."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate([encode(tokenizer, e, max_len) for e in examples[i : i + batch_size]], tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        shift_logits, shift_labels = logits[:, :-1], batch["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(
            shift_logits.reshape(-1, shift_logits.shape[-1]),
            shift_labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        total += float(losses)
        count += int((shift_labels != -100).sum())
    return total / max(count, 1)


@torch.no_grad()
def generate_answers(
    model, tokenizer, examples: list[Example], batch_size: int, max_new_tokens: int, max_len: int
) -> list[str]:
    device = next(model.parameters()).device
    answers: list[str] = []
    for i in range(0, len(examples), batch_size):
        prompts = [prompt_ids(tokenizer, e.prompt)[-(max_len - max_new_tokens) :] for e in examples[i : i + batch_size]]
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


def evaluate(model, tokenizer, examples: list[Example], cfg: EvalSection, train_cfg: TrainSection) -> dict[str, float]:
    from rouge_score import rouge_scorer

    start = time.perf_counter()
    examples = examples[: cfg.max_examples]
    model.eval()
    loss = answer_loss(model, tokenizer, examples, cfg.batch_size, train_cfg.max_seq_len)
    predictions = generate_answers(
        model, tokenizer, examples, cfg.batch_size, cfg.max_new_tokens, train_cfg.max_seq_len
    )
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    em = [exact_match(p, e.answer) for p, e in zip(predictions, examples)]
    rouge = [scorer.score(e.answer, p)["rougeL"].fmeasure for p, e in zip(predictions, examples)]
    return {
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "exact_match": sum(em) / len(em),
        "rouge_l": sum(rouge) / len(rouge),
        "eval_examples": len(examples),
        "eval_seconds": time.perf_counter() - start,
    }
