"""SubLoRA's Pareto table (seed 004, "Expected outputs"): allocation mode x intrinsic dimension on the real 4-bit
SmolLM2, one client training alone, then the compression bound on its training data.

    python -m bench.sublora_bench --out runs/sublora-bench   # uniform, fixed 0.2/0.5/0.8, learned; d 1000, 2000
    python -m bench.sublora_bench --modes uniform,learned --dims 1000 --seeds 0,1,2 --steps 48

For each (mode, d, seed): a fresh SubLoRA (``sublora.seed`` = the seed) on the frozen base, ``--steps`` AdamW steps on
the client's training examples (``--task``, ``--train-examples``), the held-out loss before and after, and the
adapter kind's ``final_report``: alpha quantised and arithmetic-coded (bits), the empirical risk under the quantised
model (smoothed bits per token, top-1 error), and the two Occam bounds (``common.adapters.sublora.bound``), plus
the learned gates per block. LoRA (r 8, the same steps at ``train.learning-rate``) is the reference row. Writes
``sublora.json`` and ``sublora.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.compare_merge import machine, machine_name
from common.adapters import ReportsBound, adapter_kind
from common.adapters.sublora.model import subspace_of
from common.data import client_data
from common.evaluation import answer_loss
from common.model import load_base_model, load_tokenizer
from common.training import round_learning_rate, train_round
from strategies import load_run_config

MODES = {"uniform": {}, "learned": {"sublora.allocation": "learned"}}


def mode_overrides(mode: str) -> dict[str, Any]:
    """``uniform``, ``learned`` or ``fixed:<ratio>`` (d_B / d) as run-config keys."""
    if mode.startswith("fixed:"):
        return {"sublora.allocation": "fixed", "sublora.allocation-ratio": float(mode.split(":", 1)[1])}
    if mode not in MODES:
        raise SystemExit(f"--modes: '{mode}' is not uniform, learned or fixed:<ratio>")
    return dict(MODES[mode])


def run_one(base, tokenizer, flat: dict[str, Any], args) -> tuple[dict[str, Any], Any]:
    cfg = load_run_config(flat)
    adapter = adapter_kind(cfg.adapter)(base, cfg)
    train, held_out = client_data(cfg.data, args.partition, args.clients, cfg.seed)
    held_out = held_out[: args.eval_examples]
    adapter.begin(None, adapter.initial)  # type: ignore[arg-type]  # neither LoRA nor SubLoRA reads client state
    if args.before is None:  # every adapter starts as the base model: its held-out loss once
        args.before = answer_loss(adapter.model, tokenizer, held_out, cfg.eval.batch_size, cfg.train.max_seq_len)
    before = args.before
    start = time.perf_counter()
    settings = cfg.train_settings()
    losses = []
    for server_round in range(1, args.rounds + 1):
        adapter.prepare_training()
        lr = round_learning_rate(settings, server_round, args.rounds)
        out = train_round(
            adapter.model, tokenizer, train, settings, lr, seed=server_round, lr_groups=adapter.lr_groups()
        )
        losses.append(out["train_loss"])
    seconds = time.perf_counter() - start
    after = answer_loss(adapter.model, tokenizer, held_out, cfg.eval.batch_size, cfg.train.max_seq_len)
    sent, _ = adapter.outgoing()
    row: dict[str, Any] = {
        "numbers_sent": int(sum(v.size for v in sent.values())),
        "train_examples": len(train),
        "held_out_before": before,
        "held_out_after": after,
        "train_loss_first_round": losses[0],
        "train_loss_last_round": losses[-1],
        "train_seconds": seconds,
    }
    if isinstance(adapter, ReportsBound):
        row.update(adapter.final_report(tokenizer, train, cfg.eval.batch_size, cfg.train.max_seq_len))
        gates = subspace_of(adapter.model).gates
        if gates is not None:
            row["gamma_per_block"] = [round(float(g), 4) for g in torch.sigmoid(gates.detach()).tolist()]
    return row, adapter.detach()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| adapter | d | seed | numbers sent | code bits | train bits/token (quantised) | bound bits/token | "
        "train top-1 error | bound top-1 error | held-out loss before -> after |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        cells = [
            r["adapter"],
            str(r.get("d", "–")),
            str(r["seed"]),
            f"{r['numbers_sent']:,}",
            f"{r['bound_code_bits']:,}" if "bound_code_bits" in r else "–",
            f"{r['bound_train_bits_per_token']:.3f}" if "bound_code_bits" in r else "–",
            f"{r['bound_bits_per_token']:.1f}" if "bound_code_bits" in r else "–",
            f"{r['bound_train_top1_error']:.3f}" if "bound_code_bits" in r else "–",
            f"{r['bound_top1_error']:.3f}" if "bound_code_bits" in r else "–",
            f"{r['held_out_before']:.3f} -> {r['held_out_after']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="uniform,fixed:0.2,fixed:0.5,fixed:0.8,learned")
    parser.add_argument("--dims", default="1000,2000")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of --steps (the lr decays across rounds)")
    parser.add_argument("--steps", type=int, default=6, help="AdamW steps per round")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--task", default="boolq")
    parser.add_argument("--train-examples", type=int, default=0, help="> 0: at most this many training examples")
    parser.add_argument("--eval-examples", type=int, default=64)
    parser.add_argument("--run-config", default="", help="more run-config overrides, 'k=v k=v' (JSON values)")
    parser.add_argument("--no-lora", action="store_true", help="skip the LoRA reference row")
    parser.add_argument("--out", default="runs/sublora-bench")
    args = parser.parse_args()
    args.partition, args.clients, args.before = 0, 1, None
    common: dict[str, Any] = {
        "strategy": "local",
        "data.tasks": args.task,
        "train.local-steps": args.steps,
        "train.batch-size": args.batch_size,
        "data.max-train-examples": args.train_examples,
    }
    for item in args.run_config.split():
        key, value = item.split("=", 1)
        common[key] = json.loads(value) if value[:1] in '0123456789-[{tf"' else value
    base = load_base_model("smollm2-135m-instruct", "nf4", "cpu")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    seeds = [int(s) for s in args.seeds.split(",")]
    plan: list[tuple[str, int | None, int, dict[str, Any]]] = []
    if not args.no_lora:
        plan += [("lora r=8", None, s, {"seed": s}) for s in seeds]
    for dim in (int(x) for x in args.dims.split(",")):
        for mode in args.modes.split(","):
            for s in seeds:
                flat = {"local.adapter": "sublora", "sublora.intrinsic-dim": dim, "sublora.seed": s, "seed": s}
                plan.append((f"sublora {mode}", dim, s, {**flat, **mode_overrides(mode)}))
    for name, d, seed, flat in plan:
        row, base = run_one(base, tokenizer, {**common, **flat}, args)
        row.update({"adapter": name, "d": d, "seed": seed})
        rows.append(row)
        print(json.dumps(row), flush=True)
        m = machine()
        (out / "sublora.json").write_text(json.dumps({"machine": m, "args": vars(args), "rows": rows}, indent=1))
        where = machine_name(m)
        budget = f"{args.rounds} rounds x {args.steps} steps x batch {args.batch_size}, task {args.task}"
        (out / "sublora.md").write_text(
            f"# SubLoRA: allocation x dimension\n\nMachine: {where}. Budget: {budget}.\n\n{table(rows)}\n"
        )


if __name__ == "__main__":
    main()
