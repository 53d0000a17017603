"""The documentation: the configuration reference is the generated one, pyproject.toml and the pydantic sections
list the same keys, and every relative link and ``#anchor`` in README.md and docs/ resolves."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_the_generated_one(reference: ModuleType) -> None:
    assert reference.main(["--check"]) == 0, "run `python scripts/config_reference.py --write` and commit the result"


def test_pyproject_and_the_pydantic_sections_list_the_same_keys(reference: ModuleType) -> None:
    in_pyproject = set(reference.pyproject_entries())
    in_models = set(reference.pydantic_keys())
    assert not in_pyproject - in_models, f"keys in pyproject.toml that no section defines: {in_pyproject - in_models}"
    assert not in_models - in_pyproject, f"section keys missing from pyproject.toml: {in_models - in_pyproject}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation other than '-' and '_' dropped,
    each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text.replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def test_slug_follows_github() -> None:
    assert slug("Comparing strategies: `python -m bench.compare`") == "comparing-strategies-python--m-benchcompare"
    assert slug("SimGrad: clients with different base models (FedMosaic)") == (
        "simgrad-clients-with-different-base-models-fedmosaic"
    )
    assert slug("`tasks-clustered`: ATLAS and MIRA") == "tasks-clustered-atlas-and-mira"
    assert slug("Why not Flower's `Strategy`") == "why-not-flowers-strategy"
    assert slug("`run_dir` [link](x.md)") == "run_dir-link"


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def without_code_spans(line: str) -> str:
    """A code span may hold brackets and parentheses that are not a link; a link's text may be a code span."""
    return CODE_SPAN.sub(lambda m: m.group(2) if m.start() and line[m.start() - 1] == "[" else "code", line)


def links(path: Path) -> list[tuple[int, str]]:
    return [
        (number, target)
        for number, line in prose_lines(path.read_text())
        for target in LINK.findall(without_code_spans(line))
    ]


def test_anchors_count_duplicates(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A\n## Results\n```bash\n# not a heading\n```\n## Results\n")
    assert anchors(page) == {"a", "results", "results-1"}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if path_part.startswith("/"):
            resolved = ROOT / path_part.lstrip("/")
        else:
            resolved = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: ({target})"
        if not resolved.exists():
            broken.append(f"{where} no such file")
        elif anchor:
            if resolved.suffix != ".md":
                broken.append(f"{where} an anchor into a file that is not markdown")
            elif anchor not in anchors(resolved):
                broken.append(f"{where} no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_readme_is_one_screen_and_maps_every_page() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 150
    linked = {(ROOT / unquote(t.partition("#")[0])).resolve() for _, t in links(readme) if not t.startswith("#")}
    pages = {p.resolve() for p in DOCS.rglob("*.md") if "results" not in p.relative_to(DOCS).parts}
    assert not pages - linked, f"docs pages the README does not link: {sorted(str(p) for p in pages - linked)}"
