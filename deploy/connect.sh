#!/usr/bin/env bash
# Add a `flwr` connection for a TLS SuperLink and register SuperNode public keys with it.
#   deploy/connect.sh [NAME] [host:port]           then: flwr run . NAME --stream
# Environment: TESSERA_CERTS (ca.crt and node-*.pub to register; default deploy/certs); REGISTER=0 only writes
# the connection (e.g. before the SuperLink answers).
set -euo pipefail
source "$(dirname "$0")/../scripts/usage.sh"
cd "$(dirname "$0")/.."
source scripts/flwr_env.sh
NAME=${1:-tessera}; ADDRESS=${2:-127.0.0.1:9092}
CERTS=$(cd "${TESSERA_CERTS:-deploy/certs}" && pwd)
# (re)write the connection: an older entry of the same name may point at another address or CA
CONFIG="$FLWR_HOME/config.toml"
awk -v section="[superlink.$NAME]" '$0 == section {skip = 1; next} /^\[/ {skip = 0} !skip' "$CONFIG" > "$CONFIG.tmp"
printf '[superlink.%s]\naddress = "%s"\nroot-certificates = "%s"\n' "$NAME" "$ADDRESS" "$CERTS/ca.crt" >> "$CONFIG.tmp"
mv "$CONFIG.tmp" "$CONFIG"
[ "${REGISTER:-1}" = 0 ] && exit 0
for pub in "$CERTS"/node-*.pub; do
  flwr supernode register "$pub" "$NAME" || echo "[connect] $pub: not registered (already registered?)"
done
