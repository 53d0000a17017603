#!/usr/bin/env bash
# Install, then run the default demo: FedAvg over LoRA on the real 4-bit SmolLM2 with 3 clients of distinct
# tasks. Extra arguments go to --run-config, e.g. `bash scripts/demo.sh "secure=true min-train-replies=3"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/flwr_env.sh
trap stop_local_superlink EXIT
flwr run . local --stream --federation-config "num-supernodes=${TESSERA_CLIENTS:-3}" ${1:+--run-config "$1"}
