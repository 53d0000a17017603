"""A node's data (a file, a folder of files or a ``save_to_disk`` directory) read with ``datasets``, row by row.

Reading: JSON Lines / JSON (``.jsonl``, ``.json``: one object a line, or one array of objects), CSV (``.csv``),
Parquet (``.parquet``), a folder of such files (all of one kind, read in name order), and a directory written by
``Dataset.save_to_disk`` (its ``train`` split if it holds a ``DatasetDict``). JSON files are scanned line by line
before ``datasets`` reads them, because pyarrow's own error for a bad line says neither which line nor why: the
scan names the line of invalid JSON, of bytes that are not UTF-8 and of a row longer than ``data.max-row-chars``.

Every problem is a ``DataError``: its message (what may reach the server) has the row and the field; its detail
(for the node's operator) adds the file and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .example import DataError, Example
from .formats import FORMATS, HINTS, RowError, detect_format, to_example

READERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")  # what Dataset.save_to_disk writes


@dataclass
class FileData:
    """What one file gave: its format, its examples and how many prompts were cut to ``data.max-prompt-chars``."""

    format: str
    examples: list[Example]
    clipped: int = 0
    problems: list[str] = field(default_factory=list)  # the first rows refused, for ``check`` (strict=False)


def _fail(path: Path, reason: str, fix: str) -> DataError:
    return DataError(reason, f"{path}: {reason}. {fix}")


def _rows(path: Path, max_row_chars: int) -> Iterable[Mapping[str, Any]]:
    """The rows of the file or folder, through ``datasets`` (memory-mapped Arrow: a large file is not held as Python
    objects)."""
    if not path.exists():
        raise _fail(path, "the data file does not exist", "Check data-path in the node config (an absolute path).")
    if path.is_dir():
        if any((path / marker).exists() for marker in SAVED_MARKERS):
            return _saved_dataset(path)
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in READERS)
    else:
        files = [path]
    if not files:
        raise _fail(
            path,
            "the folder holds no data file and is not a saved dataset",
            f"Put files ending in {sorted(READERS)} in it, or give a directory written by Dataset.save_to_disk.",
        )
    readers = {READERS.get(p.suffix.lower()) for p in files}
    if None in readers:
        raise _fail(
            path,
            f"files ending in {path.suffix or '(nothing)'!r} are not read",
            f"Use one of {sorted(READERS)} or a directory written by Dataset.save_to_disk.",
        )
    if len(readers) > 1:
        raise _fail(path, f"the folder mixes {sorted(map(str, readers))} files", "Keep one kind of file in it.")
    reader = str(readers.pop())
    for number, file in enumerate(files, 1):
        try:
            _check_file(file, reader, max_row_chars)
        except DataError as err:
            if len(files) == 1:
                raise
            raise DataError(f"file {number} of {len(files)} in the folder: {err}", err.detail) from None
    import datasets

    try:
        return datasets.load_dataset(reader, data_files=[str(f) for f in files], split="train")
    except Exception as err:  # pyarrow / pandas: name the kind of problem, keep their words for the operator
        cause = err.__cause__ or err
        raise DataError(
            f"the {reader} reader refused the file ({type(cause).__name__})",
            f"{path}: the {reader} reader refused it: {str(cause)[:300]}. Every row must have the same columns "
            "with the same kinds of values.",
        ) from err


def _check_file(path: Path, reader: str, max_row_chars: int) -> None:
    """Readable, not empty, and (JSON) every line valid: what ``datasets`` would fail on without saying where."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as err:
        raise _fail(path, f"the data file cannot be read ({err.strerror})", "Check its permissions.") from err
    if size == 0:
        raise _fail(path, "the data file is empty", "Point data-path at a file with examples in it.")
    if reader == "json":
        _scan_json(path, max_row_chars)


def _saved_dataset(path: Path) -> Any:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:
        raise _fail(
            path, "the directory is not a saved dataset", "Give a file, or a directory written by save_to_disk."
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise _fail(path, f"the saved DatasetDict has no 'train' split ({sorted(loaded)})", "Save one split.")
        loaded = loaded["train"]
    return loaded


def _scan_json(path: Path, max_row_chars: int) -> None:
    """Name the first line that is not UTF-8, not JSON, not an object, or longer than ``max_row_chars``."""
    with open(path, "rb") as handle:
        first = handle.read(64).lstrip()
    if first.startswith(b"["):  # one JSON array: parse it whole, the decoder gives the line
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise _fail(path, f"byte {err.start} is not UTF-8", "Save the file as UTF-8.") from err
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise _fail(path, f"line {err.lineno} is not valid JSON ({err.msg})", "Fix that line.") from err
        for number, row in enumerate(rows, 1):
            _check_row(path, number, row, len(json.dumps(row)), max_row_chars)
        return
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _fail(
                    path, f"line {number} is not UTF-8 (byte {err.start} of the line)", "Save the file as UTF-8."
                ) from err
            if len(line) > max_row_chars:
                raise _fail(
                    path,
                    f"line {number} has {len(line):,} characters, over data.max-row-chars ({max_row_chars:,})",
                    "Split that document into several rows, or raise data.max-row-chars.",
                )
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise _fail(
                    path, f"line {number} is not valid JSON ({err.msg}, column {err.colno})", "Fix that line."
                ) from err
            _check_row(path, number, row, len(line), max_row_chars)


def _check_row(path: Path, number: int, row: Any, size: int, max_row_chars: int) -> None:
    if not isinstance(row, dict):
        raise _fail(path, f"row {number} is a JSON {type(row).__name__}, not an object", "Make every row an object.")
    if size > max_row_chars:
        raise _fail(
            path,
            f"row {number} has {size:,} characters, over data.max-row-chars ({max_row_chars:,})",
            "Split that document into several rows, or raise data.max-row-chars.",
        )


def read_file(
    path: str | Path, fmt: str = "auto", max_prompt_chars: int = 400, max_row_chars: int = 200_000, strict: bool = True
) -> FileData:
    """Every row of the file as an ``Example``. ``fmt``: one of ``FORMATS``, or ``auto`` (from the columns).
    ``strict``: the first bad row is a DataError (a node refuses data it cannot read whole); False (the ``check``
    command): bad rows are listed in ``problems`` (the first 10) and left out."""
    path = Path(path).expanduser()
    rows = _rows(path, max_row_chars)
    columns = list(getattr(rows, "column_names", None) or [])
    if fmt == "auto":
        try:
            fmt = detect_format(columns)
        except DataError as err:
            raise DataError(str(err), f"{path}: {err.detail}") from None
    elif fmt not in FORMATS:
        raise _fail(path, f"unknown data format {fmt!r}", f"Name one of {list(FORMATS)}, or 'auto'.")
    out = FileData(fmt, [])
    for number, row in enumerate(_iterate(rows), 1):
        try:
            example, clipped = to_example(row, fmt, max_prompt_chars)
        except RowError as err:
            problem = _fail(path, f"row {number}: {err} (format {fmt})", _row_fix(fmt))
            if strict:
                raise problem from None
            if len(out.problems) < 10:
                out.problems.append(problem.detail)
            continue
        out.examples.append(example)
        out.clipped += clipped
    if not out.examples:
        raise _fail(path, f"no row could be read as {fmt}", _row_fix(fmt))
    return out


def _row_fix(fmt: str) -> str:
    return f"In the {fmt} format {HINTS[fmt]}; or name another format with data-format."


def _iterate(rows: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """Rows in batches where the reader has them (an Arrow table reads faster a thousand rows at a time)."""
    batches = getattr(rows, "iter", None)
    if batches is None:
        yield from rows
        return
    for batch in batches(batch_size=1000):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            yield dict(zip(keys, values))
