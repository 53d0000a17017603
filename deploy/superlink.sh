#!/usr/bin/env bash
# Start a SuperLink with TLS and SuperNode authentication. Every setting is an environment variable:
#   TESSERA_CERTS   directory from `python -m deploy.certs`      (default: deploy/certs)
#   SUPERLINK_HOST  address the SuperLink listens on             (default: 127.0.0.1)
#   SUPERLINK_PORT  its one port for Fleet, Control and Runtime  (default: 9093 with FLEET_GATE, else 9092)
#   FLEET_GATE      host:port the SuperNodes connect to, e.g. 0.0.0.0:9092: starts deploy/fleet_gate.py there,
#                   which passes the Fleet API only (Flower's Control API has no user authentication: whoever
#                   reaches it can run code on every node, so it stays on this host's loopback)
#   SUPERLINK_DB    state database; a file keeps runs across restarts (default: $FLWR_HOME/state.db)
# Extra arguments are passed to flower-superlink (its own flags: flower-superlink --help). See
# docs/reliability-security.md.
set -euo pipefail
source "$(dirname "$0")/../scripts/usage.sh"
cd "$(dirname "$0")/.."
source scripts/flwr_env.sh
CERTS=${TESSERA_CERTS:-deploy/certs}
HOST=${SUPERLINK_HOST:-127.0.0.1}
PORT=${SUPERLINK_PORT:-$([ -n "${FLEET_GATE:-}" ] && echo 9093 || echo 9092)}
if [ -n "${FLEET_GATE:-}" ]; then
  python3 -m deploy.fleet_gate --listen "$FLEET_GATE" --superlink "127.0.0.1:$PORT" --certs "$CERTS" &
  trap 'kill $! 2>/dev/null' EXIT
fi
if [ "$HOST" != 127.0.0.1 ] && [ "$HOST" != localhost ] && [ "$HOST" != ::1 ]; then
  echo "[superlink] WARNING: listening on $HOST exposes the Control API (flwr run) to that network;" \
       "prefer SUPERLINK_HOST=127.0.0.1 with FLEET_GATE=<address>:9092" >&2
fi
flower-superlink \
  --ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/server.pem" --ssl-keyfile "$CERTS/server.key" \
  --enable-supernode-auth \
  --host "$HOST" --port "$PORT" \
  --database "${SUPERLINK_DB:-$FLWR_HOME/state.db}" "$@"
