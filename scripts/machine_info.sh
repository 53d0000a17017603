#!/usr/bin/env bash
# What a test log needs to be traced to its machine. `cpu`: the CPU, cores and the instruction sets the 4-bit
# path depends on (AVX512-BF16 selects bitsandbytes' packed CPU kernel, see docs/cpu-4bit.md); works before
# anything is installed. `versions`: the libraries as installed, and what torch and bitsandbytes detected.
PY=${PYTHON:-python3}
if [[ "${1:-cpu}" == cpu ]]; then
  echo "[machine] $(uname -m), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | xargs)"
  flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  have="" lack=""
  for f in avx2 avx512f avx512_bf16 amx_bf16 avx512_vnni; do
    if grep -qw "$f" <<<"$flags"; then have+=" $f"; else lack+=" $f"; fi
  done
  echo "[machine] CPU has:${have:- (none)}; lacks:${lack:- (none)}"
  exit 0
fi
"$PY" - <<'PY'
import importlib.metadata as md

import torch

from common.bnb_cpu import cpu_kernel_available

names = ["torch", "transformers", "peft", "bitsandbytes", "flwr", "accelerate", "numpy"]
print("[machine] " + ", ".join(f"{n} {md.version(n)}" for n in names))
print(f"[machine] torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
      f"CUDA {torch.cuda.is_available()}; bitsandbytes packed 4-bit CPU kernel: {cpu_kernel_available()}")
PY
