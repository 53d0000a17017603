#!/usr/bin/env bash
# Install, lint and type-check, then run the whole test suite (unit tests, then the end-to-end runs on the real
# 4-bit model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/machine_info.sh versions
bash scripts/lint.sh
python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 "$@" tests
