"""Client side of SimGrad's sanitised gradient signatures.

A client describes its data by the gradient of the answer loss with respect to the output layer (lm_head) of a
FROZEN probe model, count-sketched over the vocabulary to a small (buckets x hidden) matrix. Before it leaves the
client the signature is smoothed across rounds (EMA), noised and randomly subsampled (``sanitize_signature``).
The server compares signatures by cosine (``strategies.relevance``).
"""

from __future__ import annotations

import numpy as np
import torch

from common.data import Example
from common.training import IGNORE, collate, encode

from ..sketches import count_sketch, sanitize_signature

__all__ = ["count_sketch", "probe_gradient", "sanitize_signature"]


def probe_gradient(
    model, tokenizer, examples: list[Example], buckets: int, seed: int, max_len: int, batch_size: int = 4
) -> np.ndarray:
    """Count sketch S G of the lm_head-weight gradient of the answer-token cross-entropy, flattened (buckets * d,).

    For answer positions t (all examples together, T of them) with final hidden state h_t (the input of
    ``model.get_output_embeddings()``, captured by a forward hook), logits z_t (that module's output),
    p_t = softmax(z_t) and target y_t, the exact gradient of the mean loss is G = (1/T) sum_t (p_t - e_{y_t}) h_t^T
    (V x d). S (buckets x V) has S[bucket[v], v] = sign[v] from ``count_sketch(V, buckets, seed)``. Computed in
    closed form under ``torch.no_grad`` (no backward pass, the model is not modified): each (p_t - e_{y_t}) is
    sketched to ``buckets`` with ``index_add_`` and multiplied by h_t. Causal shift: z_t predicts token t + 1.
    Works for a plain HF or a peft causal LM; the math is float32. The model is put in eval mode for the probe
    and its train/eval mode restored afterwards.
    """
    if not examples:
        raise ValueError("probe_gradient needs at least one example")
    head = model.get_output_embeddings()
    vocab, hidden = head.weight.shape
    device = head.weight.device
    bucket_np, sign_np = count_sketch(vocab, buckets, seed)
    bucket_ids = torch.from_numpy(bucket_np).to(device)
    signs = torch.from_numpy(sign_np).to(device)
    encoded = [encode(tokenizer, e, max_len) for e in examples]

    captured: dict[str, torch.Tensor] = {}

    def hook(module, inputs, output):
        captured["h"], captured["z"] = inputs[0], output

    acc = torch.zeros((buckets, hidden), dtype=torch.float32, device=device)
    tokens = 0
    was_training = model.training
    handle = head.register_forward_hook(hook)
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(encoded), batch_size):
                batch = collate(encoded[start : start + batch_size], tokenizer.pad_token_id)
                labels = batch["labels"].to(device)
                model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
                h, z = captured.pop("h"), captured.pop("z")
                mask = labels[:, 1:] != IGNORE  # position t predicts token t + 1
                if not mask.any():
                    continue
                targets = labels[:, 1:][mask]
                h_t = h[:, :-1][mask].float()  # (T_b, d)
                resid = torch.softmax(z[:, :-1][mask].float(), dim=-1)  # (T_b, V): p_t
                resid[torch.arange(len(targets), device=device), targets] -= 1.0  # p_t - onehot(y_t)
                sketched = torch.zeros((len(targets), buckets), dtype=torch.float32, device=device)
                sketched.index_add_(1, bucket_ids, resid.mul_(signs))  # (T_b, buckets) = (S (p_t - e_y))^T
                acc += sketched.T @ h_t
                tokens += len(targets)
    finally:
        handle.remove()
        model.train(was_training)
    if tokens == 0:
        raise ValueError("no answer tokens in the probe examples (max_len too small?)")
    return (acc / tokens).cpu().numpy().astype(np.float32).ravel()
