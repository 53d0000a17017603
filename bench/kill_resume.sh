#!/usr/bin/env bash
# Kill a real federation mid-run and resume it: `bash bench/kill_resume.sh "<run-config>" [round]` runs the demo
# (`scripts/demo.sh`, `flwr run . local`) with the run-config, SIGKILLs every process of it (flwr run, the managed
# SuperLink, the simulation, Ray and its actors) once `round` (default 1) is checkpointed, then runs it again with
# `resume=true`. The run-config must set `run-dir` (absolute) and more rounds than `round`. Logs go beside the run dir.
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=$1; after=${2:-1}
run_dir=$(python3 -c "import re, sys; m = re.search(r\"run-dir='(/[^']+)'\", sys.argv[1]); print(m[1] if m else '')" "$cfg")
[ -n "$run_dir" ] || { echo "the run-config needs an absolute run-dir='/...'" >&2; exit 2; }
export FLWR_HOME=${FLWR_HOME:-$run_dir.flwr-home}
checkpointed() { python3 -c "import json; print(json.load(open('$run_dir/checkpoint/state.json'))['round'])" 2>/dev/null \
  || echo -1; }
setsid bash scripts/demo.sh "$cfg" > "$run_dir.first.log" 2>&1 &
first=$!
until [ "$(checkpointed)" -ge "$after" ]; do
  kill -0 $first 2>/dev/null || { echo "the run ended before round $after was checkpointed" >&2; exit 1; }
  sleep 2
done
python3 - "$first" <<'PY'
import sys, psutil
root = psutil.Process(int(sys.argv[1]))
procs = [root, *root.children(recursive=True)]
for proc in procs:
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        pass
psutil.wait_procs(procs, timeout=30)
print(f"[kill_resume] SIGKILLed {len(procs)} processes")
PY
wait "$first" 2>/dev/null || true  # reap it (its status is the SIGKILL)
echo "[kill_resume] checkpoint after the kill: round $(checkpointed); resuming"
bash scripts/demo.sh "$cfg resume=true" > "$run_dir.resume.log" 2>&1
echo "[kill_resume] resumed run finished: $run_dir/metrics.jsonl"
