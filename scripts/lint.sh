#!/usr/bin/env bash
# Lint (ruff: rules and formatting, lines of at most 120 characters) and type-check (mypy); settings in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
echo "[lint] ruff and mypy clean"
