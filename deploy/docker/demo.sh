#!/usr/bin/env bash
# The docker-compose demo, start to end: build the image (cached), start a TLS + SuperNode-auth SuperLink, register
# the node keys, start 3 SuperNodes, run a FedAvg `secure=true` (SecAgg+) federation on the real 4-bit model,
# copy the run directory out, print each node's held-out loss and where the metrics and plots are, and `down`.
#   bash deploy/docker/demo.sh [--rounds N] [--keep] [--gpu] [--out DIR] [--run-config "key=value ..."]
#     --build-only     build the image (and its base) and stop: no federation (CI builds it beside the unit tests)
#     --rounds N       server rounds (default 2)
#     --keep           leave the federation up afterwards (stop it with --down)
#     --gpu            add deploy/docker-compose.gpu.yml (CUDA SuperNodes; NVIDIA hosts only)
#     --out DIR        where the run directory and logs go (default runs/docker/<run name>)
#     --run-config S   more run-config, appended to the demo's (e.g. "train.local-steps=8")
#     --down           only stop a federation left up by --keep (volumes kept: registered keys, past runs)
#     --purge          the same, and delete its volumes (the SuperLink's database with the registered keys, runs)
# Environment (all optional): TESSERA_MEMBER_DATA (deploy/member-data: each node's own data, in node-<i>/; written
# by the demo when absent), COMPOSE_PROJECT_NAME (tessera), TESSERA_SUPERLINK_PORT (9092), TESSERA_PUBLISH
# (127.0.0.1), TESSERA_BASE (base image; default: python:3.11-slim where it can be had, else local/debian:bookworm
# built by deploy/docker/build-base.sh), TESSERA_DOCKER_CERTS (deploy/certs/docker), TESSERA_CONNECTION
# (tessera-docker, the host's `flwr` connection), TESSERA_CACHE (the asset cache, ~/.cache/tessera).
# Needs: a running Docker engine, docker-compose (v1) or `docker compose` (v2), and `bash scripts/setup.sh` done on
# the host (the `flwr` CLI, the certificate tool and the asset cache that the containers mount read-only).
set -euo pipefail
source "$(dirname "$0")/../../scripts/usage.sh"
cd "$(dirname "$0")/../.."
ROOT=$PWD
ROUNDS=2 KEEP=0 GPU=0 OUT="" EXTRA="" DOWN="" BUILD_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --gpu) GPU=1; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    --run-config) EXTRA=$2; shift 2 ;;
    --down) DOWN=(down --remove-orphans); shift ;;
    --purge) DOWN=(down --remove-orphans -v); shift ;;
    *) echo "[demo] unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
say() { echo "[demo $(date +%H:%M:%S)] $*"; }
source scripts/flwr_env.sh   # FLWR_HOME, no telemetry / update checks

export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-tessera}
export TESSERA_ASSETS=${TESSERA_CACHE:-$HOME/.cache/tessera}
# Each SuperNode's own data, mounted in that node only (node-<i>/); the run config names no data.
export TESSERA_MEMBER_DATA=${TESSERA_MEMBER_DATA:-$ROOT/deploy/member-data}
export TESSERA_DOCKER_CERTS=${TESSERA_DOCKER_CERTS:-$ROOT/deploy/certs/docker}
export TESSERA_SUPERLINK_PORT=${TESSERA_SUPERLINK_PORT:-9092}
CONNECTION=${TESSERA_CONNECTION:-tessera-docker}
COMPOSE_FILES=(-f deploy/docker-compose.yml)
[ "$GPU" = 1 ] && COMPOSE_FILES+=(-f deploy/docker-compose.gpu.yml)
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
compose() { "${COMPOSE[@]}" "${COMPOSE_FILES[@]}" "$@"; }
if [ -n "${DOWN[*]}" ]; then compose "${DOWN[@]}"; exit; fi

if ! docker info >/dev/null 2>&1; then
  echo "[demo] no Docker engine answers (start dockerd; see docs/deployment.md)" >&2; exit 1
fi
command -v flwr >/dev/null || { echo "[demo] no flwr CLI: run bash scripts/setup.sh first" >&2; exit 1; }
# The real model and data on the host, once (no-op when present); the containers mount them read-only.
python3 -m common.assets >/dev/null
# The containers' user (uid 49999) reads it: caches converted before common/assets.py made them 0644 hold 0600
# weights (safetensors writes them so).
chmod -R a+rX "$TESSERA_ASSETS/models" "$TESSERA_ASSETS/data"
# Three members' own data (real text in three formats: chat JSONL, Alpaca JSON, Parquet), unless already there.
if [ ! -d "$TESSERA_MEMBER_DATA/node-0" ]; then python3 -m common.data members "$TESSERA_MEMBER_DATA"; fi
chmod -R a+rX "$TESSERA_MEMBER_DATA"

NAME="demo-$(date +%Y%m%d-%H%M%S)"
OUT=${OUT:-runs/docker/$NAME}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
T0=$(date +%s)
finish() {
  local rc=$?
  if [ "$rc" != 0 ]; then  # every container's log beside the run, for the post-mortem
    mkdir -p "$OUT/logs"
    for service in $(compose ps --services 2>/dev/null); do
      compose logs --no-color "$service" > "$OUT/logs/$service.log" 2>&1 || true
    done
    say "FAILED (exit $rc): container logs in $OUT/logs"
  fi
  if [ "$KEEP" = 0 ]; then compose down --remove-orphans >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap finish EXIT

# 1. The image. Base: what the operator says, else python:3.11-slim where a registry has it, else a Debian
# bookworm base made here from the Debian mirror (no registry needed).
if [ -z "${TESSERA_BASE:-}" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1
  then TESSERA_BASE=python:3.11-slim
  else TESSERA_BASE=local/debian:bookworm; bash deploy/docker/build-base.sh "$TESSERA_BASE"
  fi
fi
export TESSERA_BASE
# Build inputs that stay in the build stage: the CA bundle pip trusts here (a TLS-intercepting proxy needs it) and,
# where pip gets torch from a local wheel directory instead of PyTorch's index, that wheel.
INPUTS=deploy/docker/build-inputs
mkdir -p "$INPUTS/wheels"
PIP_CA=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
[ -f "${PIP_CA:-}" ] || PIP_CA=/etc/ssl/certs/ca-certificates.crt
if [ -f "$PIP_CA" ]; then cmp -s "$PIP_CA" "$INPUTS/ca.crt" || cp "$PIP_CA" "$INPUTS/ca.crt"; fi
TORCH_VERSION=$(grep -oP 'ARG TORCH_VERSION=\K\S+' deploy/docker/Dockerfile)
FIND_LINKS="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
[ "$GPU" = 1 ] && FIND_LINKS=""   # the CUDA image takes torch from PyTorch's CUDA index, never a local CPU wheel
for dir in $FIND_LINKS; do
  wheel=$(ls "$dir"/torch-"$TORCH_VERSION"+cpu-cp311-*x86_64.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    [ -f "$INPUTS/wheels/$(basename "$wheel")" ] || cp "$wheel" "$INPUTS/wheels/"
    export TESSERA_TORCH_INDEX_URL=""
    break
  fi
done
say "building the image (base $TESSERA_BASE; cached layers are reused)"
B0=$(date +%s)
BUILD_SERVICES=(superlink)
[ "$GPU" = 1 ] && BUILD_SERVICES+=(supernode-0)
compose build "${BUILD_SERVICES[@]}" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
say "image ${TESSERA_IMAGE:-tessera:cpu} ready in $(( $(date +%s) - B0 )) s ($(docker image inspect \
  -f '{{.Size}}' "${TESSERA_IMAGE:-tessera:cpu}" | awk '{printf "%.2f GB", $1 / 1e9}'))"
if [ "$BUILD_ONLY" = 1 ]; then exit 0; fi

# 2. Certificates (kept when present: registered keys stay valid) for every name the SuperLink is reached by;
# the private keys are handed to the containers' user (uid 49999), the public halves stay readable here.
python3 -m deploy.certs --out "$TESSERA_DOCKER_CERTS" --nodes 3 \
  --hosts "superlink,fleet-gate,localhost,127.0.0.1${TESSERA_EXTRA_HOSTS:+,$TESSERA_EXTRA_HOSTS}" >/dev/null
docker run --rm --user 0 --entrypoint chown -v "$TESSERA_DOCKER_CERTS:/certs" "${TESSERA_IMAGE:-tessera:cpu}" \
  49999:49999 /certs/server.key /certs/node-0.key /certs/node-1.key /certs/node-2.key

# 3. SuperLink (+ fleet gate); wait until it answers the Control API over TLS, then register the node keys.
say "starting the SuperLink (TLS, SuperNode authentication) on ${TESSERA_PUBLISH:-127.0.0.1}:$TESSERA_SUPERLINK_PORT"
compose up -d superlink fleet-gate
TESSERA_CERTS=$TESSERA_DOCKER_CERTS REGISTER=0 bash deploy/connect.sh "$CONNECTION" "127.0.0.1:$TESSERA_SUPERLINK_PORT"
for _ in $(seq 90); do
  flwr supernode list "$CONNECTION" >/dev/null 2>&1 && break
  sleep 2
done
flwr supernode list "$CONNECTION" >/dev/null || { echo "[demo] the SuperLink does not answer" >&2; exit 1; }
TESSERA_CERTS=$TESSERA_DOCKER_CERTS bash deploy/connect.sh "$CONNECTION" "127.0.0.1:$TESSERA_SUPERLINK_PORT"

# 4. The SuperNodes; wait until the SuperLink lists all three online.
say "starting 3 SuperNodes"
compose up -d
online() {
  flwr supernode list "$CONNECTION" --format json 2>/dev/null | python3 -c \
    "import json, sys; print(sum(n.get('status', '').lower() == 'online' for n in json.load(sys.stdin)['nodes']))" \
    2>/dev/null || echo 0
}
for _ in $(seq 90); do [ "$(online)" -ge 3 ] && break; sleep 2; done
[ "$(online)" -ge 3 ] || { echo "[demo] only $(online) of 3 SuperNodes came online" >&2; exit 1; }

# 5. The federation: FedAvg over LoRA on the real 4-bit model, every round's sum through SecAgg+ (3 nodes, one
# secure group). The ServerApp writes runs/$NAME on the `runs` volume (TESSERA_RUN_ROOT=/app in the container).
say "flwr run: $ROUNDS round(s), FedAvg, secure=true"
R0=$(date +%s)
flwr run . "$CONNECTION" --stream --run-config \
  "num-server-rounds=$ROUNDS strategy='fedavg' secure=true min-train-replies=3 run-dir='runs/$NAME' \
robust.bind-partitions=true $EXTRA" \
  2>&1 | tee "$OUT/flwr-run.log"
RUN_S=$(( $(date +%s) - R0 ))
# `flwr run` exits 0 even when the ServerApp failed: the SuperLink's record of the run decides (deploy/outcome.py)
python3 -m deploy.outcome "$CONNECTION" "$OUT/flwr-run.log" || { echo "[demo] the run failed" >&2; exit 1; }
docker cp "$(compose ps -q superlink):/app/runs/$NAME/." "$OUT/"
[ -f "$OUT/metrics.jsonl" ] || { echo "[demo] the run wrote no metrics (see $OUT/flwr-run.log)" >&2; exit 1; }

# 6. What happened, per node: a run whose exit code is 0 while a node's loss never moved is a failure.
python3 - "$OUT/metrics.jsonl" <<'EOF'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
per_node = {}
for row in rows:
    if row.get("node") is not None and row.get("eval_loss") is not None:
        per_node.setdefault(row["partition_id"], {})[row["round"]] = row["eval_loss"]
print("node  held-out loss (round 0 -> last)")
fell = True
for pid in sorted(per_node):
    first, last = per_node[pid][min(per_node[pid])], per_node[pid][max(per_node[pid])]
    fell &= last < first
    print(f"{pid:>4}  {first:.3f} -> {last:.3f}  {'fell' if last < first else 'DID NOT FALL'}")
if len(per_node) < 3 or not fell:
    sys.exit(f"[demo] {len(per_node)} node(s) reported, and not every node's held-out loss fell")
EOF
say "done: run ${RUN_S} s, whole demo $(( $(date +%s) - T0 )) s"
say "metrics: $OUT/metrics.jsonl; plots: $(ls "$OUT"/*.png 2>/dev/null | tr '\n' ' ')"
say "the run's log: $OUT/flwr-run.log; the final adapter: $OUT/adapter"
if [ "$KEEP" = 1 ]; then say "left up (--keep); stop it with: bash deploy/docker/demo.sh --down"; fi
