#!/usr/bin/env bash
# Install, then run the default demo: FedAvg over LoRA on the real 4-bit SmolLM2 with 3 clients of distinct
# tasks. Extra arguments go to --run-config, e.g. `bash scripts/demo.sh "secure=true min-train-replies=3"`.
# Exits non-zero when the run fails (a refused run config included), though `flwr run` itself exits 0 then.
# Environment: TESSERA_CLIENTS (simulated clients, default 3). Every run-config key: docs/configuration.md.
set -euo pipefail
source "$(dirname "$0")/usage.sh"
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/flwr_env.sh
LOG=$(mktemp "${TMPDIR:-/tmp}/tessera-demo.XXXXXX")
trap 'stop_local_superlink; rm -f "$LOG"' EXIT
flwr run . local --stream --federation-config "num-supernodes=${TESSERA_CLIENTS:-3}" ${1:+--run-config "$1"} 2>&1 \
  | tee "$LOG"
python3 -m deploy.outcome local "$LOG"
