#!/usr/bin/env bash
# Install, lint and type-check, then run the whole test suite (unit tests, then the end-to-end runs on the real
# 4-bit model). What CI runs (`bash .ci/run`). The fast loop alone: pytest -m "not e2e".
set -euo pipefail
source "$(dirname "$0")/usage.sh"
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-assets
bash scripts/machine_info.sh versions
# The model and task data (about 85 s on a fresh machine: GGUF conversions, mostly one core) beside lint; the tests
# wait for them (so the demo's image build, in the e2e phase, finds them there).
python3 -m common.assets > /tmp/tessera-assets.log 2>&1 &
ASSETS_PID=$!
# The chaos test on a real network (tests/test_e2e_network.py) needs iproute2 and iptables (Debian's packages); as
# root, install what is missing. Without them it skips, and -rs prints why.
if [ "$(id -u)" = 0 ] && ! { command -v iptables && command -v ip && command -v tc; } >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables iproute2; } >/dev/null 2>&1 \
    || echo "[test] could not install iptables/iproute2: the network test will skip"
fi
# The Docker demo test (tests/test_e2e_docker.py) needs a Docker engine, docker-compose and, for the registry-free
# base image, debootstrap (Debian's packages): as root, install what is missing and start the engine for this run
# if none answers (there is no systemd here). Without them it skips, and -rs prints why.
DOCKERD_PID=""
if [ "$(id -u)" = 0 ]; then
  if ! { command -v dockerd && command -v docker-compose && command -v debootstrap; } >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose \
      debootstrap; } >/dev/null 2>&1 || echo "[test] could not install docker.io/docker-compose: the Docker test skips"
  fi
  if command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; then
    dockerd > /tmp/tessera-dockerd.log 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  fi
fi
stop_dockerd() {
  local rc=$?
  if [ -n "$DOCKERD_PID" ]; then kill "$DOCKERD_PID" 2>/dev/null; wait "$DOCKERD_PID" 2>/dev/null || true; fi
  exit "$rc"
}
trap stop_dockerd EXIT
bash scripts/lint.sh
wait "$ASSETS_PID" || { echo "[test] fetching the assets failed:"; tail -20 /tmp/tessera-assets.log; exit 1; }
echo "[test] set-up and lint done at ${SECONDS} s"
# The unit tests and the in-process federations (tiny models; each in a child process with its own Ray: marked
# inprocess by tests/conftest.py) on every core; then the real-model end-to-end runs in two lanes at once, each one
# test file at a time: the deployment tests (marked deployment: SuperLink and SuperNodes as processes of one thread
# each, waiting on the network and on Flower's heartbeats much of the time), and the simulation files (Ray) from a
# queue that both lanes take from, the deployment lane once its own tests have ended. Each lane prints as it goes,
# each line prefixed with its lane.
workers=$(python3 -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
# The queue: every file with a real-model simulation test, in pytest's order (collected beside the unit tests).
SIMULATIONS="not deployment"
QUEUE=$(mktemp /tmp/tessera-e2e-queue.XXXXXX)
collect() {  # exit 5: nothing selected (a -k that leaves no simulation test), an empty queue
  local status=0
  python3 -m pytest --collect-only -q -p no:cacheprovider -m "e2e and not inprocess and $SIMULATIONS" "$@" tests \
    > "$QUEUE.collected" 2>&1 || status=$?
  { grep -o '^tests/[^:]*\.py' "$QUEUE.collected" || true; } | uniq > "$QUEUE"
  [ "$status" = 0 ] || [ "$status" = 5 ] || { tail -20 "$QUEUE.collected"; return 1; }
}
collect "$@" &
COLLECT_PID=$!
# Every phase runs whatever the one before gives; the script fails if any did.
rc=0
python3 -m pytest -q -p no:cacheprovider -rfEs --durations=20 -n "$workers" -m "not e2e or inprocess" "$@" tests || rc=$?
echo "[test] unit tests and in-process federations done at ${SECONDS} s"
wait "$COLLECT_PID" || { echo "[test] collecting the simulation files failed"; rc=1; }
e2e_lane() {  # NAME MARKER-EXPRESSION PATH [pytest args]: one lane; its exit status is kept through the prefixing pipe
  local name=$1 marker=$2 path=$3
  shift 3
  local status=0
  python3 -m pytest -v -p no:cacheprovider -rfEs --durations=0 -m "e2e and not inprocess and $marker" "$@" \
    "$path" 2>&1 | sed -u "s/^/[$name] /" || status=${PIPESTATUS[0]}
  echo "[test] e2e lane $name: $path done at ${SECONDS} s (exit $status)"
  return "$status"
}
take() {  # the queue's next file (nothing once it is empty), taken under a lock: two lanes never take the same one
  (flock 9 && head -n 1 "$QUEUE" && sed -i 1d "$QUEUE") 9> "$QUEUE.lock"
}
# A simulation's ClientApp actors compute with one torch thread each (Ray passes OMP_NUM_THREADS on), and
# deploy.local_sim.flwr_run then gives a simulated client one CPU: one actor per core. Two threads of one actor wait
# for each other whenever the other lane holds a core; one-thread actors use whatever the other lane leaves idle.
simulations() {  # NAME [pytest args]: the queue's files, one at a time, until it is empty
  local name=$1 status=0 file
  shift
  while file=$(take) && [ -n "$file" ]; do
    OMP_NUM_THREADS=1 e2e_lane "$name" "$SIMULATIONS" "$file" "$@" || status=$?
  done
  return "$status"
}
# The deployment lane builds the demo's image (its base made from the Debian mirror, then pip's packages: minutes of
# downloads and unpacking on a fresh machine, nothing on a warm one) while its network and loopback tests run. Built
# before the unit tests, it slowed them by 230 s on a fresh machine and put its load beside their in-process
# federations' reply limits (the whole run 2,492 -> 2,459 s). The Docker test runs after the build has ended; it
# builds what the build did not (a failure here shows up there). Then the lane helps with the simulations.
deployment_lane() {
  local build="" status=0
  if docker info >/dev/null 2>&1; then
    bash deploy/docker/demo.sh --build-only --out /tmp/tessera-image-build > /tmp/tessera-image-build.log 2>&1 &
    build=$!
  fi
  e2e_lane deployment "deployment" tests --ignore=tests/test_e2e_docker.py "$@" || status=$?
  if [ -n "$build" ]; then
    wait "$build" || echo "[test] building the demo's image beforehand failed: $(tail -3 /tmp/tessera-image-build.log)"
  fi
  e2e_lane docker "deployment" tests/test_e2e_docker.py "$@" || status=$?
  simulations deployment "$@" || status=$?
  return "$status"
}
deployment_lane "$@" &
DEPLOYMENT_LANE=$!
simulations simulation "$@" &
SIMULATION_LANE=$!
wait "$DEPLOYMENT_LANE" || rc=$?
wait "$SIMULATION_LANE" || rc=$?
echo "[test] e2e lanes done at ${SECONDS} s"
rm -f "$QUEUE" "$QUEUE.lock" "$QUEUE.collected"
exit "$rc"
