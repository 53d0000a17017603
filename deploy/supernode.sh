#!/usr/bin/env bash
# Start a SuperNode (e.g. on a GPU box) that authenticates to the SuperLink with its private key.
#   deploy/supernode.sh <partition-id> <num-partitions> [extra node-config]
# Extra node-config (space-separated key=value), the member's own settings: data-path='/srv/notes.jsonl' (its data:
# docs/own-data.md), dp-record-epsilon=3.0 (its record-level DP-SGD budget; with dp-record-delta, dp-record-clip:
# docs/privacy.md), keep-evaluation=true (its held-out metrics and counts stay on the node), allow-run-config-paths,
# model="qwen2.5-coder-0.5b-instruct" (or a checkpoint dir / .gguf),
# max-micro-batch=1 (memory budget: batches go through in slices of at most this many examples, same update),
# worker="off" (load the model in every ClientApp process instead of the node's model worker), worker-idle-timeout=1800.
# Environment: TESSERA_CERTS (needs ca.crt and node-<partition-id>.key), SUPERLINK (host:port, default
# 127.0.0.1:9092), SUPERNODE_HOST / SUPERNODE_PORT (its ClientAppIO address, default 127.0.0.1:9094+id),
# NODE_KEY (default $TESSERA_CERTS/node-<partition-id>.key). Several SuperNodes sharing one machine's CPUs should
# set OMP_NUM_THREADS (e.g. 1): each ClientApp process otherwise uses every core and they thrash.
set -euo pipefail
source "$(dirname "$0")/../scripts/usage.sh"
[ $# -ge 2 ] || usage_error "needs <partition-id> and <num-partitions>"
[[ $1 =~ ^[0-9]+$ && $2 =~ ^[0-9]+$ && $1 -lt $2 ]] || usage_error "partition-id must be a whole number below num-partitions"
cd "$(dirname "$0")/.."
source scripts/flwr_env.sh
PID=$1; NUM=$2; EXTRA=${3:-}
CERTS=${TESSERA_CERTS:-deploy/certs}
exec flower-supernode \
  --root-certificates "$CERTS/ca.crt" \
  --superlink "${SUPERLINK:-127.0.0.1:9092}" \
  --auth-supernode-private-key "${NODE_KEY:-$CERTS/node-$PID.key}" \
  --host "${SUPERNODE_HOST:-127.0.0.1}" --port "${SUPERNODE_PORT:-$((9094 + PID))}" \
  --node-config "partition-id=$PID num-partitions=$NUM $EXTRA"
