#!/usr/bin/env bash
# On the GPU machine, after `bash bench/gpu_carry.sh` here, as ONE device call:
#   run(command="bash bench/gpu_device.sh all", carry=[".gpu"], timeout_s=600)      # or bench | federation
# Installs the carried wheels (no network there), unpacks the task bank and the tokenizer, records the machine, then
# runs bench.gpu_bench (the plain HF QLoRA loop beside Tessera's training path, Llama 1B and 7B shapes, checkpointing
# off and on) and/or bench.gpu_federation (a SuperLink and 3 SuperNodes on the GPU: FedAvg and SimGrad, plain and
# SecAgg+, 2 rounds), each under its own time limit, writing their JSON, tables and logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  || exit 1
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1 TESSERA_CACHE=/tmp/tessera-cache
mkdir -p "$TESSERA_CACHE/data" && tar -xzf .gpu/data.tgz -C "$TESSERA_CACHE/data" && tar -xzf .gpu/tokenizer.tgz -C /tmp
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 -c "import torch, transformers, peft, bitsandbytes, flwr; print(torch.__version__, transformers.__version__,
peft.__version__, bitsandbytes.__version__, flwr.__version__, torch.cuda.get_device_name(0))"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# Each step under its own limit (a row of gpu_bench is written as it finishes), so one slow step leaves the others'.
if [[ $what == bench || $what == all ]]; then
  timeout "${BENCH_1B_SECONDS:-120}" python3 -m bench.gpu_bench --shapes llama-1b --out "$OUT/gpu-1b.json" \
    > "$OUT/gpu_bench_1b.log" 2>&1
  echo "gpu_bench 1B exit $?"; tail -12 "$OUT/gpu_bench_1b.log"
  timeout "${BENCH_7B_SECONDS:-180}" python3 -m bench.gpu_bench --shapes llama-7b --checkpointing on \
    --out "$OUT/gpu-7b.json" > "$OUT/gpu_bench_7b.log" 2>&1
  echo "gpu_bench 7B exit $?"; tail -12 "$OUT/gpu_bench_7b.log"
fi
if [[ $what == federation || $what == all ]]; then
  timeout "${FEDERATION_SECONDS:-240}" python3 -m bench.gpu_federation --tokenizer /tmp/tokenizer --out "$OUT" \
    > "$OUT/gpu_federation.log" 2>&1
  echo "gpu_federation exit $?"; tail -20 "$OUT/gpu_federation.log"
fi
