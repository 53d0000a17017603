"""Does a comparison's number depend on the machine? The same run on the numeric paths a CPU can take.

    python -m bench.numeric_path_check --out runs/numeric-path [--preset tasks-distinct] [--rounds 1]

Runs local-only, seed 0, of a preset through ``bench.compare`` three times and compares every client's held-out loss
at round 0 (the base model) and at the end:

- ``fp32``: the presets' path (``model.cpu-packed-inference=false``: evaluation in fp32 on every CPU);
- ``fp32, AVX2 only``: the same with PyTorch, oneDNN and MKL held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``,
  ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``): the kernels a CPU without AVX-512 runs, which is
  how a machine of the other kind is stood in for on this one;
- ``packed bf16``: ``model.cpu-packed-inference=true``, where the CPU has AVX512-BF16 (bitsandbytes' packed kernel).

Writes ``numeric-path.json`` (each variant's per-client losses and the largest differences) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.compare_merge import machine

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
VARIANTS = {
    "fp32": ({}, ""),
    "fp32, AVX2 only": (AVX2_ONLY, ""),
    "packed bf16": ({}, "model.cpu-packed-inference=true"),
}


def losses(report: dict) -> dict[str, dict[int, float]]:
    """round ("first" / "last") -> client -> held-out loss."""
    last = max(r["round"] for r in report["rows"])
    return {
        name: {r["client"]: r["eval_loss"] for r in report["rows"] if r["round"] == rnd}
        for name, rnd in (("first", 0), ("last", last))
    }


def largest_difference(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> dict[str, float]:
    return {key: max(abs(a[key][c] - b[key][c]) for c in a[key]) for key in a}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/numeric-path")
    parser.add_argument("--preset", default="tasks-distinct")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": machine(), "preset": args.preset, "rounds": args.rounds, "variants": {}}
    for name, (env, run_config) in VARIANTS.items():
        if name == "packed bf16" and not result["machine"]["avx512_bf16"]:
            continue
        where = out / name.replace(",", "").replace(" ", "-")
        cmd = [sys.executable, "-m", "bench.compare", "--preset", args.preset, "--rounds", str(args.rounds)]
        cmd += ["--strategies", "local", "--seeds", "0", "--out", str(where), "--run-config", run_config]
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: bench.compare failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        report = json.loads((where / "compare.json").read_text())
        result["variants"][name] = {"env": env, "run_config": run_config, "losses": losses(report)}
        print(f"[numeric-path] {name}: {result['variants'][name]['losses']}", flush=True)
    reference = result["variants"]["fp32"]["losses"]
    result["largest_difference_from_fp32"] = {
        name: largest_difference(v["losses"], reference) for name, v in result["variants"].items() if name != "fp32"
    }
    (out / "numeric-path.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["largest_difference_from_fp32"], indent=1))
    return result


if __name__ == "__main__":
    main()
