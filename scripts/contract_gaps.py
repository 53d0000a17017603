"""What the import contracts miss of ``strategies/``: lint fails while a strategy package is not in them.

    python scripts/contract_gaps.py        # run by scripts/lint.sh; exit 1 and one line per gap

The contracts in pyproject.toml list the strategy packages by hand, so a package missing from them could import a
sibling and still pass import-linter. Every module of ``strategies/`` (a package: a directory with an
``__init__.py``; or a ``.py`` file) but the registry and ``__init__`` is either a shared module (a source of the
contract that forbids the strategy packages) or a strategy package, which must be in the independence contract and
among that contract's forbidden modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib  # Python 3.11+ (CI's); lint only

ROOT = Path(__file__).resolve().parents[1]


def contract_gaps(root: Path) -> list[str]:
    """One line per module of ``root/strategies`` that the contracts in ``root/pyproject.toml`` leave out."""
    contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    independent = {m for c in contracts if c["type"] == "independence" for m in c["modules"]}
    shared_contracts = [
        c
        for c in contracts
        if c["type"] == "forbidden" and any(m.startswith("strategies.") for m in c["source_modules"])
    ]
    shared = {m for c in shared_contracts for m in c["source_modules"]}
    forbidden_to_shared = {m for c in shared_contracts for m in c["forbidden_modules"]}
    folder = root / "strategies"
    modules = {f"strategies.{p.parent.name}" for p in folder.glob("*/__init__.py")}
    modules |= {f"strategies.{p.stem}" for p in folder.glob("*.py") if p.stem not in ("__init__", "registry")}
    gaps = []
    for module in sorted(modules - shared):
        if module not in independent:
            gaps.append(f"{module}: not in the independence contract")
        if module not in forbidden_to_shared:
            gaps.append(f"{module}: not among the modules the shared modules may not import")
    return gaps


if __name__ == "__main__":
    found = contract_gaps(ROOT)
    for gap in found:
        print(f"[lint] pyproject.toml [tool.importlinter]: {gap} (see docs/adding-a-strategy.md)", file=sys.stderr)
    sys.exit(1 if found else 0)
