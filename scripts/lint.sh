#!/usr/bin/env bash
# Lint (ruff: rules and formatting, lines of at most 120 characters), type-check (mypy) and check the import layers
# (import-linter's contracts: common < strategies < client_app | server_app < bench, strategies independent of each
# other); settings in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
"$PY" -c "import sys; from importlinter.cli import lint_imports_command; sys.argv[1:] = ['--no-cache']; lint_imports_command()"
"$PY" scripts/contract_gaps.py  # the contracts list the strategy packages by hand: none may be missing
echo "[lint] ruff, mypy and the import contracts clean"
