#!/usr/bin/env bash
# Start a SuperNode (e.g. on a GPU box) that authenticates to the SuperLink with its private key.
#   deploy/supernode.sh <partition-id> <num-partitions> [extra node-config]
# Extra node-config (space-separated key=value): model="qwen2.5-coder-0.5b-instruct" (or a checkpoint dir / .gguf),
# max-micro-batch=1 (memory budget: batches go through in slices of at most this many examples, same update),
# worker="off" (load the model in every ClientApp process instead of the node's model worker), worker-idle-timeout=1800.
# Environment: TESSERA_CERTS (needs ca.crt and node-<partition-id>.key), SUPERLINK (host:port, default
# 127.0.0.1:9092), SUPERNODE_HOST / SUPERNODE_PORT (its ClientAppIO address, default 127.0.0.1:9094+id),
# NODE_KEY (default $TESSERA_CERTS/node-<partition-id>.key). Several SuperNodes sharing one machine's CPUs should
# set OMP_NUM_THREADS (e.g. 1): each ClientApp process otherwise uses every core and they thrash.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/flwr_env.sh
PID=${1:?partition-id}; NUM=${2:?num-partitions}; EXTRA=${3:-}
CERTS=${TESSERA_CERTS:-deploy/certs}
exec flower-supernode \
  --root-certificates "$CERTS/ca.crt" \
  --superlink "${SUPERLINK:-127.0.0.1:9092}" \
  --auth-supernode-private-key "${NODE_KEY:-$CERTS/node-$PID.key}" \
  --host "${SUPERNODE_HOST:-127.0.0.1}" --port "${SUPERNODE_PORT:-$((9094 + PID))}" \
  --node-config "partition-id=$PID num-partitions=$NUM $EXTRA"
