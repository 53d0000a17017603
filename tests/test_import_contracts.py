"""The layers are a check, not a convention: import-linter's contracts (pyproject.toml's, and the two that
``scripts/import_contracts.py`` derives from the strategy registry) hold for the tree, and they catch a strategy that
imports a sibling and a ``common`` module that imports a strategy; a strategy added as one folder and one registry
line is in them with no other file changed."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "strategies", "client_app", "server_app", "bench", "deploy")


def lint_imports(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``scripts/import_contracts.py`` (what lint runs) on the tree at ``root``."""
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "import_contracts.py"), *args],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HOME": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def tree_copy(tmp_path):
    for package in (*PACKAGES, "scripts", "docs"):
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
        ("strategies/base.py", "import server_app.live as _app", "strategies is not allowed to import server_app"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tree_copy, module, line, broken):
    path = tree_copy / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout[-3000:]


def add_toy_strategy(root: Path) -> Path:
    """tests/toy_strategy.py as a strategy package of the tree at ``root`` (its imports made relative, as a package
    under strategies/ has them), and the one line that registers it. Nothing else is changed."""
    toy = (ROOT / "tests" / "toy_strategy.py").read_text()
    toy = toy.replace(
        "from strategies import ClientInfo, FinalAdapter, Group, GroupResult, Strategy, StrategyClient, StrategySpec, "
        "register\nfrom strategies.base import Arrays\nfrom strategies.client import ClientRuntime\n",
        "from ..base import Arrays, ClientInfo, FinalAdapter, Group, GroupResult, Strategy\n"
        "from ..client import ClientRuntime, StrategyClient\nfrom ..spec import StrategySpec\n",
    ).replace("SPEC = register(StrategySpec(", "SPEC = (StrategySpec(")
    assert "from ..spec import StrategySpec" in toy and "register(" not in toy
    package = root / "strategies" / "toymean"
    package.mkdir()
    (package / "__init__.py").write_text(toy)
    registry = root / "strategies" / "registry.py"
    text = registry.read_text()
    line = "    for spec in (FEDAVG, FEDAVG_DUAL, FEDSA_LORA, SIMGRAD, LOCAL, MIRA, ATLAS, VEMOE):"
    assert line in text
    registry.write_text(
        text.replace(line, line.replace("VEMOE)", "VEMOE, __import__('strategies.toymean').toymean.SPEC)"))
    )
    return package


def test_a_strategy_added_as_one_folder_and_one_registry_line_is_in_the_contracts_and_the_reference(tree_copy):
    package = add_toy_strategy(tree_copy)
    shown = lint_imports(tree_copy, "--show")
    assert shown.returncode == 0, shown.stderr[-3000:]
    independence = shown.stdout.split('type = "independence"')[1]
    assert '"strategies.toymean"' in independence and '"strategies.fedavg"' in independence
    assert '"strategies.toymean"' in shown.stdout.split('type = "forbidden"')[2]  # the shared modules may not import it
    result = lint_imports(tree_copy)
    assert result.returncode == 0 and "0 broken" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
    (package / "__init__.py").write_text(
        (package / "__init__.py").read_text() + "\nfrom ..mira import config  # noqa\n"
    )
    result = lint_imports(tree_copy)
    assert result.returncode != 0 and "strategies.toymean is not allowed to import strategies.mira" in result.stdout
    env = {"PYTHONPATH": str(tree_copy), "PATH": "/usr/bin:/bin", "HOME": str(tree_copy)}
    script = [sys.executable, "scripts/config_reference.py"]
    reference = subprocess.run(script, cwd=tree_copy, env=env, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0 and "`toymean.step`" in reference.stdout, reference.stderr[-2000:]
    check = subprocess.run([*script, "--check"], cwd=tree_copy, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 1 and "out of date" in check.stderr  # the docs check asks for its keys to be written


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
