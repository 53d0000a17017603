"""The Flower app bundle (FAB) that `flwr run` builds from this repository: the app's code, all of it, and nothing
else. Flower's default takes every .md and .json in the tree, so the comparison reports under docs/results once
grew the bundle past Flower's 10 MB limit and every `flwr run` failed before round 1."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_disk
from flwr.common.constant import FAB_MAX_SIZE

ROOT = Path(__file__).resolve().parents[1]
APP_PACKAGES = ("common", "strategies", "client_app", "server_app")


def test_the_bundle_is_the_apps_code_and_stays_far_below_flowers_limit():
    fab = build_fab_from_disk(ROOT)
    names = set(zipfile.ZipFile(io.BytesIO(fab)).namelist())
    code = {str(p.relative_to(ROOT)) for pkg in APP_PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert code <= names, sorted(code - names)[:5]  # every module the ServerApp and ClientApp may import
    others = {n for n in names if n.split("/")[0] not in APP_PACKAGES and n not in ("pyproject.toml", "LICENSE")}
    assert not {n for n in others if not n.startswith(".info/")}, sorted(others)[:5]  # no docs, tests, results
    assert len(fab) < FAB_MAX_SIZE // 4, len(fab)  # room to grow: the code is ~0.7 MB (2026-11-27)
