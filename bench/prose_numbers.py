"""The result numbers quoted in the README's and the docs' prose, checked against the stored reports.

A verdict quoted in a sentence (``-0.014 [-0.022, -0.011]``: an estimate and its 95 % interval, or ``Holm p 0.011``)
must be one that a stored report holds: an interval record or Holm p-value anywhere in a JSON file under
``docs/results/``, or a line of a table generated from one (``bench.tables``, ``bench.record_dp_table``), which
``bench.tables --check`` holds to its report. A number edited by hand, or left behind when its report was re-run,
is named with its page and line. Tables, code blocks and the dated history of ``docs/results-archive.md`` (made
from reports that are no longer stored) are not read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.verdicts import interval_text

INTERVAL = re.compile(r"([+\-−]\d+\.\d{3}) \[([+\-−]\d+\.\d{3}), ([+\-−]\d+\.\d{3})\]")
HOLM = re.compile(r"Holm p (\d+(?:\.\d+)?(?:e-\d+)?)")
GENERATED = re.compile(r"^<!-- (bench\.tables|record-dp-table)\b")
HISTORY = ("results-archive.md",)


def _records(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for inner in value.values():
            yield from _records(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _records(inner)


def stored_numbers(results: Path) -> tuple[set[str], set[str]]:
    """(intervals, Holm p-values) as the tables print them, of every JSON file under ``results``."""
    intervals, holm = set(), set()
    for path in sorted(results.rglob("*.json")):
        for record in _records(json.loads(path.read_text())):
            if all(isinstance(record.get(k), int | float) for k in ("estimate", "low", "high")):
                intervals.add(interval_text(record))
            if isinstance(record.get("holm_p"), int | float):
                holm.add(f"{record['holm_p']:.2g}")
    return intervals, holm


def _lines(page: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, whether it is prose) of a page: generated blocks, tables and code are not prose."""
    generated = code = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if GENERATED.match(line):
            generated = True
        elif line.startswith("<!-- /"):
            generated = False
        if line.lstrip().startswith("```"):
            code = not code
        yield number, line, not (generated or code or line.lstrip().startswith("|"))


def unsupported(pages: list[Path], results: Path, root: Path) -> list[str]:
    """``page:line: the number`` for every interval or Holm p in the prose of ``pages`` that no stored report
    holds."""
    intervals, holm = stored_numbers(results)
    prose: list[tuple[Path, int, str]] = []
    for page in pages:
        if page.name in HISTORY or not page.exists():
            continue
        for number, line, is_prose in _lines(page):
            if is_prose:
                prose.append((page, number, line.replace("−", "-")))
            else:  # a generated table's numbers are its report's (bench.tables --check)
                intervals.update(m.group(0) for m in INTERVAL.finditer(line.replace("−", "-")))
    found = []
    for page, number, line in prose:
        where = f"{page.relative_to(root)}:{number}"
        found += [f"{where}: {m.group(0)}" for m in INTERVAL.finditer(line) if m.group(0) not in intervals]
        found += [f"{where}: Holm p {m.group(1)}" for m in HOLM.finditer(line) if m.group(1) not in holm]
    return found
