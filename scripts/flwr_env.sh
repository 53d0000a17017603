# Sourced by the scripts: a project-local Flower home with a "local" simulation connection, and no network
# side-trips (no runtime `uv sync`, no telemetry, no update check).
export FLWR_HOME=${FLWR_HOME:-${TESSERA_CACHE:-$HOME/.cache/tessera}/flwr-home}
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export TESSERA_RUN_ROOT=${TESSERA_RUN_ROOT:-$PWD}
mkdir -p "$FLWR_HOME"
if [ ! -f "$FLWR_HOME/config.toml" ]; then
  printf '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n' > "$FLWR_HOME/config.toml"
fi
# Its managed local SuperLink's ports, chosen free once per home: two homes never share one SuperLink.
eval "$(python3 -m deploy.local_sim ports "$FLWR_HOME")"
# Stop the detached managed SuperLink that `flwr run . local` leaves behind (ours only: matched by FLWR_HOME).
stop_local_superlink() { pkill -f "flower-superlink.*${FLWR_HOME}" 2>/dev/null || true; }
