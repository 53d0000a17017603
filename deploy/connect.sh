#!/usr/bin/env bash
# Add a `flwr` connection for a TLS SuperLink and register SuperNode public keys with it.
#   deploy/connect.sh [NAME] [host:port]           then: flwr run . NAME --stream
# Environment: TESSERA_CERTS (ca.crt and node-*.pub to register; default deploy/certs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/flwr_env.sh
NAME=${1:-tessera}; ADDRESS=${2:-127.0.0.1:9092}
CERTS=$(cd "${TESSERA_CERTS:-deploy/certs}" && pwd)
if ! grep -q "^\[superlink\.$NAME\]" "$FLWR_HOME/config.toml"; then
  printf '\n[superlink.%s]\naddress = "%s"\nroot-certificates = "%s"\n' "$NAME" "$ADDRESS" "$CERTS/ca.crt" >> "$FLWR_HOME/config.toml"
fi
for pub in "$CERTS"/node-*.pub; do
  flwr supernode register "$pub" "$NAME" || echo "[connect] $pub: not registered (already registered?)"
done
