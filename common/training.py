"""Local training of the adapter: chat-formatted examples, loss on the answer tokens only.

Each round runs ``local-steps`` optimiser steps of ``batch-size`` x ``grad-accum-steps`` examples. The learning
rate follows a cosine decay ACROSS rounds (constant inside one round), so late rounds refine rather than undo.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .config import TrainSection
from .data import Example
from .logs import get_logger

log = get_logger("tessera.client")
IGNORE = -100


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]  # IGNORE on the prompt, token ids on the answer


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """The conversation as the model's chat template writes it (a plain "role: text" layout for a model that has
    none), ending with the assistant header when ``generation_prompt``."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if generation_prompt else "")


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def prompt_ids(tokenizer, example: Example) -> list[int]:
    """The chat-templated conversation before the example's last assistant turn, ending with the assistant header
    (what generation starts from)."""
    messages = example.messages()
    return _ids(tokenizer, _render(tokenizer, messages[:-1], generation_prompt=True))


def _pieces(tokenizer, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]:
    """The conversation as token pieces, each (ids, learned): the template's text between assistant turns is
    context; every assistant turn's text + EOS is learned. Rendered turn by turn, so that the pieces line up with
    what the template writes for the whole conversation (a template that does not render a conversation as a
    prefix of the longer one is refused: its assistant turns cannot be found)."""
    pieces: list[tuple[list[int], bool]] = []
    written = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], generation_prompt=True)
        if not before.startswith(written):
            raise ValueError("the model's chat template does not write a conversation turn by turn")
        pieces.append((_ids(tokenizer, before[len(written) :]), False))
        pieces.append((_ids(tokenizer, message["content"]) + [tokenizer.eos_token_id], True))
        written = before + message["content"] + (tokenizer.eos_token or "")
    return pieces


def encode(tokenizer, example: Example, max_len: int) -> Encoded:
    """The conversation + EOS after every assistant turn, loss on the assistant turns only; over ``max_len`` it is
    cut from the LEFT, after the last assistant turn is cut to ``max_len // 2``, so the last answer always
    survives."""
    pieces = _pieces(tokenizer, example.messages())
    last, _ = pieces[-1]
    pieces[-1] = (last[: max_len // 2], True)
    ids = [t for piece, _ in pieces for t in piece]
    labels = [t if learned else IGNORE for piece, learned in pieces for t in piece]
    return Encoded(ids[-max_len:], labels[-max_len:])


def answer_tokens(tokenizer, examples: list[Example], max_len: int) -> int:
    """The answer tokens a batch's mean loss (``batch_loss``) averages over: mean x this is the summed loss."""
    return sum(answer_token_count(encode(tokenizer, e, max_len)) for e in examples)


def encoded_length(tokenizer, example: Example) -> int:
    """Tokens of the whole conversation before any cut (what ``max_len`` is compared with)."""
    return sum(len(piece) for piece, _ in _pieces(tokenizer, example.messages()))


def collate(batch: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack(batch: list[Encoded]) -> dict[str, torch.Tensor]:
    """The batch as ONE row without padding (``train.packing``): the examples end to end, positions restarting at 0
    in each, no attention mask, and the examples' bounds in ``cu_seq_lens_q`` (cumulative lengths, transformers'
    name for them). The base model's attention (``common.attention.segment_sdpa``) attends within each example at
    the cost of its own length; other attentions read the bounds from the positions
    (``masking_utils.find_packed_sequence_indices``: a mask over the whole row).
    Each example's first label is ignored, as the shifted loss of its own padded row ignores it (here the token
    before it is the previous example's last). Same loss and gradients as ``collate``'s padded batch."""
    ids = [token for e in batch for token in e.input_ids]
    labels = [label for e in batch for label in (IGNORE, *e.labels[1:])]
    positions = [p for e in batch for p in range(len(e.input_ids))]
    bounds = torch.tensor([0, *itertools.accumulate(len(e.input_ids) for e in batch)], dtype=torch.int32)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "cu_seq_lens_q": bounds,
    }


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A batch (``collate``'s or ``pack``'s) on ``device``, but a packed row's bounds (``cu_seq_lens_q``) stay on
    the host: ``common.attention.segment_sdpa`` reads them as integers in every layer, which on a GPU copy would
    wait for the device once per layer."""
    return {k: v if k == "cu_seq_lens_q" else v.to(device) for k, v in batch.items()}


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """(rows, positions) bool: the positions whose logits predict a labelled token (position t predicts t + 1)."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE
    return keep


def labelled_forward(model, inputs: dict[str, torch.Tensor], **forward) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A batch's (``collate``'s or ``pack``'s) forward with logits only at the positions that predict a labelled
    token (transformers' ``logits_to_keep``; one row per such position, in batch order): the model's output (its
    ``logits`` those rows; ``forward``, e.g. ``use_cache``, passed on), those tokens, and the positions
    (``loss_positions``). The prompt's vocabulary-wide logits, most of a batch's and a fifth of a small model's
    forward, are never computed."""
    labels = inputs["labels"]
    keep = loss_positions(labels)
    out = model(**{k: v for k, v in inputs.items() if k != "labels"}, logits_to_keep=keep, **forward)
    return out, labels[:, 1:][keep[:, :-1]], keep


def labelled_logits(model, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``labelled_forward``'s logits, tokens and positions."""
    out, targets, keep = labelled_forward(model, inputs)
    return out.logits, targets, keep


def labelled_loss(model, inputs: dict[str, torch.Tensor], chunk_tokens: int = 0) -> torch.Tensor:
    """Mean cross-entropy over the labelled tokens of a batch, as the model's own loss, from ``labelled_logits``.

    ``chunk_tokens`` (``train.loss-chunk-tokens``): where the batch predicts more labelled tokens than that, the
    model's forward stops at the final hidden states of those positions and the lm_head and the cross-entropy take
    them that many at a time (``common.chunked_loss``): the same loss and gradients, with at most ``chunk_tokens``
    x vocabulary logits alive instead of one row per answer token. 0, or a batch within it: the logits at once."""
    from .chunked_loss import bypassed, chunked_cross_entropy, plain_lm_head

    if 0 < chunk_tokens < int(loss_positions(inputs["labels"]).sum()) and plain_lm_head(model):
        with bypassed(model.get_output_embeddings()) as head:
            out, targets, _ = labelled_forward(model, inputs)
        return chunked_cross_entropy(head, out.logits, targets, chunk_tokens) / len(targets)
    logits, targets, _ = labelled_logits(model, inputs)
    return torch.nn.functional.cross_entropy(logits.float(), targets)


def batch_loss(model, tokenizer, examples: list[Example], max_len: int) -> torch.Tensor:
    """Mean answer-token cross-entropy of one batch (with the graph, for gradients)."""
    device = next(model.parameters()).device
    batch = collate([encode(tokenizer, e, max_len) for e in examples], tokenizer.pad_token_id)
    return labelled_loss(model, to_device(batch, device))


def round_learning_rate(cfg: TrainSection, server_round: int, num_rounds: int) -> float:
    """Cosine decay from ``learning-rate`` (round 1) to ``learning-rate * min-lr-ratio`` (last round)."""
    progress = 0.0 if num_rounds <= 1 else (server_round - 1) / (num_rounds - 1)
    floor = cfg.min_lr_ratio
    return cfg.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0))))


def answer_token_count(example: Encoded) -> int:
    """The tokens of ``example`` that carry a loss (its answers)."""
    return sum(label != IGNORE for label in example.labels[1:])  # what the shifted causal-LM loss averages over


def mean_answer_loss(model, inputs: dict[str, torch.Tensor], cfg: TrainSection) -> torch.Tensor:
    """The mean cross-entropy over a batch's answer tokens (with the graph), as ``train.loss-logits`` computes it."""
    if cfg.loss_logits == "labelled":
        return labelled_loss(model, inputs, cfg.loss_chunk_tokens)
    return model(**inputs).loss


def accumulate_batch(model, batch: list[Encoded], pad_id: int, cfg: TrainSection, device) -> float:
    """Backpropagate one batch's mean answer-token loss (/ grad-accum steps); return that loss.

    With ``micro_batch_size`` below the batch size the batch goes through in slices, each slice's mean loss
    weighted by its share of the batch's answer tokens: the gradient is the whole batch's (right padding keeps
    every slice's logits identical), and peak activation memory is a slice's.
    """
    micro = cfg.micro_batch_size or len(batch)
    total = max(1, sum(answer_token_count(e) for e in batch))
    loss_sum = 0.0
    for start in range(0, len(batch), micro):
        piece = batch[start : start + micro]
        share = sum(answer_token_count(e) for e in piece) / total
        if share == 0:
            continue
        inputs = to_device(pack(piece) if cfg.packing else collate(piece, pad_id), device)
        loss = mean_answer_loss(model, inputs, cfg) * share / cfg.grad_accum_steps
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum


def trainable_and_optimizer(
    model, cfg: TrainSection, lr: float, lr_groups: list[tuple[list[torch.nn.Parameter], float]] | None = None
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The model's trainable parameters and the AdamW that steps them (``lr_groups``: as ``train_round`` takes)."""
    params = [p for p in model.parameters() if p.requires_grad]
    parts = [(params, 1.0)] if lr_groups is None else [(ps, scale) for ps, scale in lr_groups if ps]
    grouped = [id(p) for ps, _ in parts for p in ps]
    if sorted(grouped) != sorted(id(p) for p in params):
        raise ValueError("lr_groups: every trainable parameter must be in exactly one group")
    groups = [{"params": ps, "lr": lr * scale} for ps, scale in parts]
    return params, torch.optim.AdamW(groups, lr=lr, weight_decay=cfg.weight_decay)


def train_round(
    model,
    tokenizer,
    examples: list[Example],
    cfg: TrainSection,
    lr: float,
    seed: int,
    lr_groups: list[tuple[list[torch.nn.Parameter], float]] | None = None,
) -> dict[str, float]:
    """Train the model's trainable parameters in place; return loss, example/token counts and seconds.

    ``lr_groups``: (parameters, multiple of ``lr``) per group, for adapters whose parts step at different rates
    (a PQ path and a personal LoRA); None: every trainable parameter at ``lr``."""
    start = time.perf_counter()
    device = next(p for p in model.parameters() if p.requires_grad).device
    params, optimizer = trainable_and_optimizer(model, cfg, lr, lr_groups)
    rng = random.Random(seed)
    # Encoded when first drawn, not all up front: a node with 200,000 examples trains a few batches a round.
    encoded: dict[int, Encoded] = {}
    order: list[int] = []
    model.train()
    losses, tokens, loss_tokens, seen = [], 0, 0, 0
    for step in range(cfg.local_steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(cfg.grad_accum_steps):
            if len(order) < cfg.batch_size:  # epoch-style sampling: every example before any repeats
                fresh = list(range(len(examples)))
                rng.shuffle(fresh)
                order.extend(fresh)
            for i in order[: cfg.batch_size]:
                if i not in encoded:
                    encoded[i] = encode(tokenizer, examples[i], cfg.max_seq_len)
            chosen = [encoded[i] for i in order[: cfg.batch_size]]
            del order[: cfg.batch_size]
            step_loss += accumulate_batch(model, chosen, tokenizer.pad_token_id, cfg, device)
            tokens += sum(len(e.input_ids) for e in chosen)
            loss_tokens += sum(answer_token_count(e) for e in chosen)
            seen += len(chosen)
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        losses.append(step_loss)
        if (step + 1) % max(1, cfg.local_steps // 4) == 0 or step + 1 == cfg.local_steps:  # ~4 lines per round
            log.info("  step %d/%d loss %.4f", step + 1, cfg.local_steps, step_loss)
    model.eval()
    seconds = time.perf_counter() - start
    return {
        "train_loss": float(sum(losses) / len(losses)),
        "train_examples": seen,
        "train_tokens": tokens,
        "train_seconds": seconds,
        "tokens_per_second": tokens / max(seconds, 1e-9),  # every non-pad token the model saw
        # the useful ones: tokens that carry a loss (the answers); what a speed change is judged by
        "train_loss_tokens": loss_tokens,
        "loss_tokens_per_second": loss_tokens / max(seconds, 1e-9),
        **_gpu_peak(device),
    }


def _gpu_peak(device) -> dict[str, float]:
    """The GPU memory this process allocated at most since it started (CUDA only; nothing on a CPU)."""
    if getattr(device, "type", str(device)) != "cuda":
        return {}
    return {"gpu_peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20}


def token_counts(
    tokenizer,
    examples: list[Example],
    max_len: int,
    limit: int = 0,
    batch: int = 1000,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[int, int, int]:
    """(tokens, examples over ``max_len``, examples counted) of the examples as training sees them, counted cheaply
    for a large file: every turn's text is tokenised in batches (the fast tokenizer, no template rendering per
    example) and the template's own tokens per turn are added, measured once on an empty conversation. ``limit``
    > 0: at most that many examples, evenly spaced, are counted and the totals scaled to all of them (tokenising
    200,000 conversations takes ~26 s on 2 cores; the third number says how many were counted). ``progress``:
    called with (examples counted so far, examples to count) after each batch."""
    if not examples:
        return 0, 0, 0
    counted = examples[:: -(-len(examples) // limit)] if limit and len(examples) > limit else examples
    probe = Example("", "", "", (("user", ""), ("assistant", "")))
    per_pair = encoded_length(tokenizer, probe)  # the template's tokens around one user and one assistant turn
    tokens, over = 0, 0
    for start in range(0, len(counted), batch):
        chunk = counted[start : start + batch]
        texts = [m["content"] for e in chunk for m in e.messages()]
        lengths = iter(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
        for e in chunk:
            turns = len(e.messages())
            n = sum(next(lengths) for _ in range(turns)) + per_pair * (turns + 1) // 2
            tokens += n
            over += n > max_len
        if progress is not None:
            progress(start + len(chunk), len(counted))
    scale = len(examples) / len(counted)
    return round(tokens * scale), round(over * scale), len(counted)
