"""The cost of SubLoRA's subspace alone: computing every layer's (A, B) = theta_0 + P alpha and its backward, per
allocation mode, for the LoRA shapes of SmolLM2-135M's q/v at r = 8 (30 blocks) and d = 1,000 (no model needed).

    python bench/sublora_subspace_bench.py [--threads 1] [--projection fastfood]

Prints milliseconds per forward + backward (mean of 10 after 3 warm-ups). It is the overhead a SubLoRA training step
pays on top of a LoRA one; the model's own forward and backward are not in it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.adapters.sublora.layer import LayerShape, Subspace  # noqa: E402

SMOLLM2_QV = [
    LayerShape(f"model.layers.{b}.self_attn.{name}", b, 8, 576, d_out)
    for b in range(30)
    for name, d_out in (("q_proj", 576), ("v_proj", 192))
]


def milliseconds(subspace: Subspace, steps: int = 10, warmup: int = 3) -> float:
    for i in range(warmup + steps):
        if i == warmup:
            started = time.perf_counter()
        loss = torch.stack([a.sum() + b.pow(2).sum() for a, b in subspace.compute()]).sum()
        loss.backward()
    return 1000 * (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--projection", default="fastfood", choices=["fastfood", "dense"])
    parser.add_argument("--intrinsic-dim", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for allocation in ("uniform", "fixed", "learned"):
        subspace = Subspace(SMOLLM2_QV, args.intrinsic_dim, allocation, 0.5, args.projection, seed=0)
        with torch.no_grad():
            subspace.alpha.normal_(0, 0.01)
        print(f"{allocation:8s} {milliseconds(subspace):7.1f} ms per forward + backward", flush=True)


if __name__ == "__main__":
    main()
