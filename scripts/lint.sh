#!/usr/bin/env bash
# Lint (ruff: rules and formatting, lines of at most 120 characters), type-check (mypy) and check the import layers
# (import-linter's contracts: common < strategies < client_app | server_app < bench, strategies independent of each
# other, derived from the registry); settings in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
"$PY" scripts/import_contracts.py  # pyproject's contracts and the two derived from the strategy registry
echo "[lint] ruff, mypy and the import contracts clean"
