"""Check the import contracts, the strategy packages' taken from the registry: no list of them is kept by hand.

    python scripts/import_contracts.py          # run by scripts/lint.sh; import-linter's output, exit 1 if broken
    python scripts/import_contracts.py --show   # print the contracts it checks (TOML)

pyproject.toml's ``[tool.importlinter]`` holds what does not change with the strategies (the layers, ``deploy``
beside the app). The other two are derived each time from ``strategies.REGISTRY``: a strategy package is the
package of a registered strategy's server class (``strategies.<name>``), and every other module of ``strategies/``
(``base``, ``aggregation``, ``fingerprint``, ...; not the registry) is what strategies share. The strategy packages
must be independent of each other, and the shared modules may import none of them nor the registry. A new strategy
is one folder and one ``register`` call: it is in both contracts from then on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def strategy_packages() -> list[str]:
    """The package of every registered strategy's server half (``strategies.fedavg`` holds two strategies)."""
    from strategies import REGISTRY

    return sorted({".".join(spec.server.__module__.split(".")[:2]) for spec in REGISTRY.values()})


def shared_modules(root: Path, packages: list[str]) -> list[str]:
    """Every module of ``root/strategies`` (a package or a ``.py`` file) that is no strategy's, but the registry."""
    folder = root / "strategies"
    modules = {f"strategies.{p.parent.name}" for p in folder.glob("*/__init__.py")}
    modules |= {f"strategies.{p.stem}" for p in folder.glob("*.py") if p.stem not in ("__init__", "registry")}
    return sorted(modules - set(packages))


def contracts(root: Path) -> dict:
    """The whole ``[tool.importlinter]`` table: pyproject's, with the two contracts derived from the registry."""
    table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    packages = strategy_packages()
    derived = [
        {
            "name": "What strategies share imports no strategy and no registry",
            "type": "forbidden",
            "source_modules": shared_modules(root, packages),
            "forbidden_modules": ["strategies.registry", *packages],
        },
        {"name": "Strategy packages are independent of each other", "type": "independence", "modules": packages},
    ]
    return {**table, "contracts": [*table.get("contracts", []), *derived]}


def as_toml(table: dict) -> str:
    """``table`` as a ``[tool.importlinter]`` TOML document (strings, booleans and lists of strings only)."""

    def value(v: object) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)

    lines = ["[tool.importlinter]"]
    lines += [f"{k} = {value(v)}" for k, v in table.items() if k != "contracts"]
    for contract in table["contracts"]:
        lines += ["", "[[tool.importlinter.contracts]]", *(f"{k} = {value(v)}" for k, v in contract.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--show", action="store_true", help="print the contracts instead of checking them")
    args = parser.parse_args(argv)
    try:
        text = as_toml(contracts(ROOT))
    except Exception as err:  # the registry is code: a tree that cannot import it cannot be checked
        print(f"[lint] the strategy registry cannot be imported: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if args.show:
        print(text, end="")
        return 0
    from importlinter.cli import lint_imports

    with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="import-contracts-", delete=False) as handle:
        handle.write(text)
    try:
        return lint_imports(config_filename=handle.name, cache_dir=None, no_cache=True)
    finally:
        Path(handle.name).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
