"""The layers are a check, not a convention: import-linter's contracts in pyproject.toml hold for the tree, and
they catch a strategy that imports a sibling and a ``common`` module that imports a strategy."""

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
