#!/usr/bin/env bash
# Start a SuperLink with TLS and SuperNode authentication. Every setting is an environment variable:
#   TESSERA_CERTS   directory from `python -m deploy.certs`      (default: deploy/certs)
#   SUPERLINK_HOST  address to listen on                          (default: 0.0.0.0)
#   SUPERLINK_PORT  the one port for Fleet, Control and ServerAppIO (default: 9092)
#   SUPERLINK_DB    state database; a file keeps runs across restarts (default: $FLWR_HOME/state.db)
# Extra arguments are passed to flower-superlink.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/flwr_env.sh
CERTS=${TESSERA_CERTS:-deploy/certs}
exec flower-superlink \
  --ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/server.pem" --ssl-keyfile "$CERTS/server.key" \
  --enable-supernode-auth \
  --host "${SUPERLINK_HOST:-0.0.0.0}" --port "${SUPERLINK_PORT:-9092}" \
  --database "${SUPERLINK_DB:-$FLWR_HOME/state.db}" "$@"
