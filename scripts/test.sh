#!/usr/bin/env bash
# Install, lint and type-check, then run the whole test suite (unit tests, then the end-to-end runs on the real
# 4-bit model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/machine_info.sh versions
bash scripts/lint.sh
# The chaos test on a real network (tests/test_e2e_network.py) needs iproute2 and iptables (Debian's packages); as
# root, install what is missing. Without them it skips, and -rs prints why.
if [ "$(id -u)" = 0 ] && ! { command -v iptables && command -v ip && command -v tc; } >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables iproute2; } >/dev/null 2>&1 \
    || echo "[test] could not install iptables/iproute2: the network test will skip"
fi
python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 "$@" tests
