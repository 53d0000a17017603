"""The layers are a check, not a convention: import-linter's contracts in pyproject.toml hold for the tree, and
they catch a strategy that imports a sibling and a ``common`` module that imports a strategy; and no package of
``strategies/`` is left out of the contracts that list them by hand."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "strategies", "client_app", "server_app", "bench", "deploy")
LINT = (
    "import sys; from importlinter.cli import lint_imports_command; sys.argv[1:] = ['--no-cache']; "
    "lint_imports_command()"
)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LINT],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def tree_copy(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        (
            "strategies/atlas/ranks.py",
            "from ..mira import config as _sibling",
            "strategies.atlas is not allowed to import",
        ),
        ("common/data/node.py", "import strategies.registry as _above", "common is not allowed to import strategies"),
        ("strategies/base.py", "import server_app.plots as _app", "strategies is not allowed to import server_app"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tree_copy, module, line, broken):
    path = tree_copy / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout[-3000:]


def contract_gaps(root: Path) -> list[str]:
    """``scripts/contract_gaps.py``'s check (lint runs it) on the tree at ``root``."""
    spec = importlib.util.spec_from_file_location("contract_gaps", ROOT / "scripts" / "contract_gaps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.contract_gaps(root)


def test_lint_fails_while_a_strategy_package_is_not_in_the_contracts(tmp_path):
    """The same check as a step of scripts/lint.sh: a new package that imports a sibling fails lint."""
    shutil.copytree(ROOT / "strategies", tmp_path / "strategies", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "contract_gaps.py", tmp_path / "scripts" / "contract_gaps.py")
    script = [sys.executable, str(tmp_path / "scripts" / "contract_gaps.py")]
    assert subprocess.run(script, capture_output=True, text=True, timeout=60).returncode == 0
    (tmp_path / "strategies" / "newcomer").mkdir()
    (tmp_path / "strategies" / "newcomer" / "__init__.py").write_text("from ..mira import config\n")
    result = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "strategies.newcomer: not in the independence contract" in result.stderr


def test_every_strategy_package_is_in_the_contracts():
    assert contract_gaps(ROOT) == []


NEWCOMER_GAPS = [
    "strategies.newcomer: not in the independence contract",
    "strategies.newcomer: not among the modules the shared modules may not import",
]


@pytest.mark.parametrize(
    ("change", "gaps"),
    [
        ("new package", NEWCOMER_GAPS),
        ("new module", NEWCOMER_GAPS),
        ("left out of the independence contract", ["strategies.mira: not in the independence contract"]),
    ],
)
def test_a_strategy_package_missing_from_the_contracts_is_found(tmp_path, change, gaps):
    shutil.copytree(ROOT / "strategies", tmp_path / "strategies", ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    if change == "new package":  # a sibling import from it would pass lint: no contract names it
        (tmp_path / "strategies" / "newcomer").mkdir()
        (tmp_path / "strategies" / "newcomer" / "__init__.py").write_text("from ..mira import config\n")
    elif change == "new module":
        (tmp_path / "strategies" / "newcomer.py").write_text("from .mira import config\n")
    else:
        independence = pyproject.index('type = "independence"')
        pyproject = pyproject[:independence] + pyproject[independence:].replace('    "strategies.mira",\n', "", 1)
    (tmp_path / "pyproject.toml").write_text(pyproject)
    assert contract_gaps(tmp_path) == gaps


def test_no_module_imports_itself_back():
    # late imports inside functions once hid a 52-module cycle (common.config <-> strategies.registry <-> every
    # strategy); import-linter's layers do not forbid cycles inside one layer, so check the whole graph. An import
    # under TYPE_CHECKING never runs (``common.section`` names ``RunConfig`` in an annotation only), so it is no cycle
    grimp = pytest.importorskip("grimp")
    nx = pytest.importorskip("networkx")
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    edges = [(m, t) for m in graph.modules for t in graph.find_modules_directly_imported_by(m)]
    cycles = [c for c in nx.strongly_connected_components(nx.DiGraph(edges)) if len(c) > 1]
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"
