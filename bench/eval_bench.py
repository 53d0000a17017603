"""Evaluation against training on the demo's clients: what one prompt encoding for the loss and generation saves.

    python -m bench.eval_bench [--rounds 2] [--threads 1] [--out bench/results/eval.json]

The demo's three clients (SmolLM2-135M NF4, LoRA r = 8 on q/v, ``by-task``: ASDiv + CommonsenseQA, BoolQ, XSum), in
one process, one after another: per client and round, a round of training (the defaults: 4 steps of 2 examples)
then its evaluation (8 held-out examples, all 8 generated, 16 new tokens) done two ways on the same adapter:
``separate``, the loss pass then generation from a fresh left-padded encoding of each prompt (what evaluation did
until 2026-11-29), and ``shared`` (``common.evaluation.losses_and_answers``: generation continues from the loss
pass's prompt cache). Reports seconds per client and round, their sums, evaluation over training for each way, the
loss pass's own share (with as many examples evaluated as trained, the floor of that ratio), and
whether the two ways' losses agree (to float rounding) and how many answers are the same (the generation prompt of
``shared`` is the conversation as the loss sees it, cut to ``train.max-seq-len`` with the answer; ``separate`` cut
the prompt to ``max-seq-len - max-new-tokens``, so long prompts may be answered differently).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from common.adapters import attach_lora, get_adapter_arrays, set_adapter_arrays
from common.adapters.lora import LoraSection
from common.config import DataSection, EvalSection, TrainSection
from common.data import client_data
from common.evaluation import example_losses, left_padded, losses_and_answers
from common.model import load_base_model, load_tokenizer
from common.training import prompt_ids, round_learning_rate, train_round


@torch.no_grad()
def separate(model, tokenizer, examples, cfg: EvalSection, max_len: int) -> tuple[list[tuple[float, int]], list[str]]:
    """The loss pass, then batched greedy generation from each prompt encoded again (left padding)."""
    losses = example_losses(model, tokenizer, examples, cfg.batch_size, max_len)
    answers: list[str] = []
    for i in range(0, len(examples), cfg.batch_size):
        batch = examples[i : i + cfg.batch_size]
        prompts = [prompt_ids(tokenizer, e)[-(max_len - cfg.max_new_tokens) :] for e in batch]
        ids, mask = left_padded(prompts, tokenizer.pad_token_id)
        width = ids.shape[1]
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=cfg.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        answers.extend(tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out)
    return losses, answers


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the demo's clients: 1 each)")
    parser.add_argument("--out", default="bench/results/eval.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_name = "smollm2-135m-instruct"
    tokenizer = load_tokenizer(model_name)
    model = attach_lora(load_base_model(model_name, "nf4", "cpu"), LoraSection(), seed=0)
    initial = get_adapter_arrays(model)
    train_cfg, eval_cfg = TrainSection(), EvalSection()
    rows, totals = [], {"train": 0.0, "separate": 0.0, "shared": 0.0, "shared_loss": 0.0}
    for client in range(3):
        set_adapter_arrays(model, initial)  # every client starts from the same adapter, as in round 1
        train, held_out = client_data(DataSection(), client, 3, seed=0)
        examples = held_out[: eval_cfg.max_examples]
        for rnd in range(1, args.rounds + 1):
            lr = round_learning_rate(train_cfg, rnd, args.rounds)
            trained = train_round(model, tokenizer, train, train_cfg, lr, seed=rnd)["train_seconds"]
            model.eval()
            began = time.perf_counter()
            loss_a, answers_a = separate(model, tokenizer, examples, eval_cfg, train_cfg.max_seq_len)
            apart = time.perf_counter() - began
            began = time.perf_counter()
            loss_b, answers_b, loss_part = losses_and_answers(
                model, tokenizer, examples, eval_cfg.batch_size, train_cfg.max_seq_len, eval_cfg.max_new_tokens
            )
            shared = time.perf_counter() - began
            relative = max(abs(a[0] - b[0]) / max(abs(a[0]), 1e-9) for a, b in zip(loss_a, loss_b))
            same = sum(a == b for a, b in zip(answers_a, answers_b))
            rows.append(
                {"client": client, "round": rnd, "train_seconds": trained, "separate_seconds": apart,
                 "shared_seconds": shared, "shared_loss_seconds": loss_part, "loss_max_relative_difference": relative,
                 "same_answers": same}
            )  # fmt: skip
            totals["train"] += trained
            totals["separate"] += apart
            totals["shared"] += shared
            totals["shared_loss"] += loss_part
            line = f"client {client} round {rnd}: train {trained:.2f} s, evaluation separate {apart:.2f} s, "
            print(f"{line}shared {shared:.2f} s; losses within {relative:.1e}, {same}/{len(examples)} same answers")
    result = {
        "threads": args.threads,
        "rows": rows,
        "totals": totals,
        "separate_over_training": totals["separate"] / totals["train"],
        "shared_over_training": totals["shared"] / totals["train"],
        # the floor of the ratio with as many examples evaluated as trained: the loss pass alone
        "loss_over_training": totals["shared_loss"] / totals["train"],
    }
    print(f"evaluation over training: separate {result['separate_over_training']:.2f}, shared "
          f"{result['shared_over_training']:.2f} (sums: train {totals['train']:.1f} s, separate "
          f"{totals['separate']:.1f} s, shared {totals['shared']:.1f} s, of it the loss {totals['shared_loss']:.1f} s: "
          f"{result['loss_over_training']:.2f} of training)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
