"""DP-SGD on a member's training (record-level differential privacy; the accountant is ``common.record_privacy``).

Every step: a batch drawn by Poisson sampling from the training split (each record in with probability ``q``, from
the operating system's entropy, so that nobody, the server included, can re-create who was sampled: the accountant's
amplification by sampling rests on that); each example's gradient of the trainable parameters computed alone (its
own forward and backward: a batch of one, so padding, packing and micro-batches cannot mix two examples) from the
mean loss over its answer tokens; each clipped to L2 norm ``C``; N(0, (z C)^2) added to their sum per coordinate;
the sum divided by the EXPECTED batch (``q`` x records, a constant: a data-dependent count would be a release of its
own); then the optimiser steps on it (AdamW on a privatised gradient is post-processing).

So one record moves a step's summed gradient by at most ``C`` (``clipped_gradient_sum``). The loop knows no adapter
kind, only the parameters that require a gradient (tested with every adapter kind: ``tests/test_dpsgd.py``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import numpy as np
import torch

from .config import TrainSection
from .data import Example
from .logs import get_logger
from .training import Encoded, answer_token_count, collate, encode, mean_answer_loss, to_device, trainable_and_optimizer

log = get_logger("tessera.client")


def poisson_batch(rng: np.random.Generator, records: int, q: float) -> list[int]:
    """The indices of the records in one step's batch: each independently with probability ``q``."""
    return np.flatnonzero(rng.random(records) < q).tolist()


def clipped_gradient_sum(
    model, params: Sequence[torch.nn.Parameter], batch: Sequence[Encoded], pad_id: int, cfg: TrainSection, clip: float
) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """The sum over ``batch`` of each example's gradient of ``params``, each clipped to L2 norm ``clip`` first;
    with each example's loss (the mean over its answer tokens) and its gradient's norm before clipping."""
    device = params[0].device
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    losses, norms = [], []
    for example in batch:
        if answer_token_count(example) == 0:
            continue  # it has no loss, so no gradient: it adds nothing (as it would to an honest sum)
        loss = mean_answer_loss(model, to_device(collate([example], pad_id), device), cfg)
        raw = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, raw)]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
        scale = min(1.0, clip / (norm + 1e-12))
        for acc, g in zip(total, grads):
            acc.add_(g.float(), alpha=scale)
        losses.append(float(loss.detach()))
        norms.append(norm)
    return total, losses, norms


def private_train_round(
    model,
    tokenizer,
    examples: list[Example],
    cfg: TrainSection,
    lr: float,
    q: float,
    noise_multiplier: float,
    clip: float,
    lr_groups: list[tuple[list[torch.nn.Parameter], float]] | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, float]:
    """``cfg.local_steps`` DP-SGD steps (see the module docstring) on the model's trainable parameters, in place.

    Returns what ``common.training.train_round`` does, with ``train_examples`` the EXPECTED examples (steps x
    ``q`` x records: what the member is weighted by) and the loss, tokens and sampled counts for the node's own log
    (``train_loss``: the mean of the sampled examples' losses)."""
    start = time.perf_counter()
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    noise = torch.Generator().manual_seed(int(rng.integers(2**63)))
    params, optimizer = trainable_and_optimizer(model, cfg, lr, lr_groups)
    expected = q * len(examples)
    encoded: dict[int, Encoded] = {}
    model.train()
    losses, sampled, tokens, loss_tokens, clipped = [], 0, 0, 0, 0
    for step in range(cfg.local_steps):
        chosen = poisson_batch(rng, len(examples), q)
        for i in chosen:
            if i not in encoded:
                encoded[i] = encode(tokenizer, examples[i], cfg.max_seq_len)
        batch = [encoded[i] for i in chosen]
        total, step_losses, norms = clipped_gradient_sum(model, params, batch, tokenizer.pad_token_id, cfg, clip)
        for p, summed in zip(params, total):
            drawn = torch.normal(0.0, noise_multiplier * clip, size=summed.shape, generator=noise)
            p.grad = ((summed + drawn.to(summed.device)) / expected).to(p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.extend(step_losses)
        sampled += len(batch)
        tokens += sum(len(e.input_ids) for e in batch)
        loss_tokens += sum(answer_token_count(e) for e in batch)
        clipped += sum(n > clip for n in norms)
        if (step + 1) % max(1, cfg.local_steps // 4) == 0 or step + 1 == cfg.local_steps:
            log.info("  DP-SGD step %d/%d: %d sampled, %d clipped", step + 1, cfg.local_steps, len(batch), clipped)
    model.eval()
    seconds = time.perf_counter() - start
    return {
        "train_loss": float(np.mean(losses)) if losses else 0.0,
        "train_examples": round(expected * cfg.local_steps),
        "train_sampled": sampled,
        "train_clipped": clipped,
        "train_tokens": tokens,
        "train_seconds": seconds,
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "train_loss_tokens": loss_tokens,
        "loss_tokens_per_second": loss_tokens / max(seconds, 1e-9),
    }
