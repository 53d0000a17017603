"""A node's data (a file, a folder of files or a ``save_to_disk`` directory), read row by row in this process.

Reading: JSON Lines / JSON (``.jsonl``, ``.json``: one object a line, or one array of objects) with ``json``, a line
at a time; CSV (``.csv``) with ``csv``, a row at a time; Parquet (``.parquet``) with ``pyarrow``, a thousand rows
at a time; a folder of such files (all of one kind, read in name order); and a directory written by
``Dataset.save_to_disk`` (its ``train`` split if it holds a ``DatasetDict``), memory-mapped where it lies. Nothing
is copied: ``datasets.load_dataset`` would write the member's text as Arrow into the Hugging Face cache
(``~/.cache/huggingface/datasets``, outside ``data-path``, readable by other users), so it is not used here.

Each file is read twice, neither time held whole: a first pass checks it (for JSON, every line: invalid JSON,
bytes that are not UTF-8, a row that is not an object; for CSV and Parquet, the header or schema) and collects its
columns, which tell its format; the second yields its rows. Every reader refuses a row longer than
``data.max-row-chars`` (a JSON Lines line's characters; else the characters of the row's values), naming the row.

Every problem is a ``DataError``: its message (what may reach the server) has the row and the field, never a path,
a column name or a row's text; its detail (for the node's operator: logged on the node, printed by ``python -m
common.data check``) adds the file, what it holds and the fix. An ``OSError`` (a file this user may not read) is one
too, named by its kind.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .example import DataError, Example
from .formats import FORMATS, HINTS, RowError, detect_format, to_example

READERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")  # what Dataset.save_to_disk writes
BATCH_ROWS = 1000  # Parquet and saved datasets are read this many rows at a time

Row = dict[str, Any]


@dataclass
class FileData:
    """What one file gave: its format, its examples and how many prompts were cut to ``data.max-prompt-chars``."""

    format: str
    examples: list[Example]
    clipped: int = 0
    problems: list[str] = field(default_factory=list)  # the first rows refused, for ``check`` (strict=False)
    refused: int = 0  # every row refused (strict=False)


@dataclass
class _Rows:
    """A file's (or folder's) columns, known after the first pass, and its rows (the second pass, lazily)."""

    columns: list[str]
    rows: Callable[[], Iterator[Row]]


def _fail(path: Path, reason: str, fix: str) -> DataError:
    return DataError(reason, f"{path}: {reason}. {fix}")


def _too_long(path: Path, what: str, size: int, max_row_chars: int) -> DataError:
    return _fail(
        path,
        f"{what} has {size:,} characters, over data.max-row-chars ({max_row_chars:,})",
        "Split that document into several rows, or raise data.max-row-chars.",
    )


def _rows(path: Path, max_row_chars: int) -> _Rows:
    """The columns and rows of the file or folder."""
    if not path.exists():
        raise _fail(path, "the data file does not exist", "Check data-path in the node config (an absolute path).")
    if path.is_dir():
        if any((path / marker).exists() for marker in SAVED_MARKERS):
            return _saved_dataset(path, max_row_chars)
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
    if None in readers:  # a single file (a folder's files were chosen by their suffix); its suffix is its name's
        raise DataError(
            f"a file of this kind is not read (its name does not end in one of {sorted(READERS)})",
            f"{path}: files ending in {path.suffix or '(nothing)'!r} are not read. Use one of {sorted(READERS)} or "
            "a directory written by Dataset.save_to_disk.",
        )
    if len(readers) > 1:
        raise _fail(path, f"the folder mixes {sorted(map(str, readers))} files", "Keep one kind of file in it.")
    reader = str(readers.pop())
    columns: dict[str, None] = {}  # every file's columns, in the order met (a folder's files may differ)
    for number, file in enumerate(files, 1):
        with _in_folder(number, len(files)):
            _check_file(file)
            columns.update(dict.fromkeys(_FIRST_PASS[reader](file, max_row_chars)))
    names = list(columns)

    def rows() -> Iterator[Row]:
        for number, file in enumerate(files, 1):
            with _in_folder(number, len(files)):
                yield from _SECOND_PASS[reader](file, names, max_row_chars)

    return _Rows(names, rows)


@contextmanager
def _in_folder(number: int, total: int) -> Iterator[None]:
    """A DataError from the ``number``-th of ``total`` files names its place in the folder (not its name)."""
    try:
        yield
    except DataError as err:
        if total == 1:
            raise
        raise DataError(f"file {number} of {total} in the folder: {err}", err.detail) from None


def _check_file(path: Path) -> None:
    """Readable and not empty."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as err:
        raise _unreadable(path, err) from None
    if size == 0:
        raise _fail(path, "the data file is empty", "Point data-path at a file with examples in it.")


def _unreadable(path: Path, err: OSError) -> DataError:
    return DataError(
        f"the data file cannot be read ({type(err).__name__}{': ' + err.strerror if err.strerror else ''})",
        f"{path}: it cannot be read: {err}. Check its permissions (the SuperNode's user must read it).",
    )


def _row_chars(value: Any) -> int:
    """The characters of a row's text: its keys and values, nested lists and objects included."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(len(str(k)) + _row_chars(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(_row_chars(v) for v in value)
    return 0 if value is None else len(str(value))


# --- JSON Lines and JSON -------------------------------------------------------------------------------------------


BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark many Windows tools write first


def _is_array(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(64).removeprefix(BOM).lstrip().startswith(b"[")


def _not_json_lines(path: Path, number: int, line: str, err: json.JSONDecodeError) -> DataError:
    """A line that is not JSON: where the whole file is one JSON value (pretty-printed, or an object holding the
    rows), say what it is and what is expected, rather than that its first line is invalid."""
    if number == 1 and path.stat().st_size <= 64 * 2**20:
        try:
            whole = json.loads(path.read_bytes().removeprefix(BOM).decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            whole = None
        if isinstance(whole, dict):
            lists = [k for k, v in whole.items() if isinstance(v, list)]
            where = f" (its rows may be the list under {', '.join(repr(k) for k in lists[:3])})" if lists else ""
            return _fail(
                path,
                f"the file is one JSON object over several lines{where}, not rows",
                "Give one row per line (JSON Lines, .jsonl) or a JSON array of row objects (.json).",
            )
    if line.strip().startswith("{") and not line.strip().endswith("}"):  # an object begun and not ended
        return _fail(
            path,
            f"line {number} begins a JSON object that goes on over the next lines (pretty-printed JSON)",
            "JSON Lines needs each row on one line: write it compact (e.g. jq -c . file > file.jsonl).",
        )
    return _fail(path, f"line {number} is not valid JSON ({err.msg}, column {err.colno})", "Fix that line.")


def _json_columns(path: Path, max_row_chars: int) -> list[str]:
    """Name the first line that is not UTF-8, not JSON, not an object, or longer than ``max_row_chars``; the keys
    of every row."""
    keys: dict[str, None] = {}
    for number, row in _json_rows(path, max_row_chars, check=True):
        _check_row(path, number, row, max_row_chars)
        keys.update(dict.fromkeys(row))
    return list(keys)


def _json_second_pass(path: Path, columns: list[str], max_row_chars: int) -> Iterator[Row]:
    for _, row in _json_rows(path, max_row_chars, check=False):
        yield {c: row.get(c) for c in columns}  # every column in every row, as a table has them


def _json_rows(path: Path, max_row_chars: int, check: bool) -> Iterator[tuple[int, Any]]:
    """(row number, parsed row): a JSON Lines file a line at a time; one JSON array parsed whole (its text dropped
    once parsed), each row handed on and let go."""
    if _is_array(path):
        try:
            text = path.read_bytes().removeprefix(BOM).decode("utf-8")
        except UnicodeDecodeError as err:
            raise _fail(path, f"byte {err.start} is not UTF-8", "Save the file as UTF-8.") from None
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise _fail(path, f"line {err.lineno} is not valid JSON ({err.msg})", "Fix that line.") from None
        del text
        if not isinstance(rows, list):  # e.g. an object that holds the rows: say what it is
            raise _fail(
                path,
                f"the file is a JSON {type(rows).__name__}, not an array of rows",
                "Give the rows as a JSON array of objects (.json) or one object per line (.jsonl).",
            )
        for number in range(1, len(rows) + 1):
            row, rows[number - 1] = rows[number - 1], None
            yield number, row
        return
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            raw = raw.removeprefix(BOM) if number == 1 else raw
            if not raw.strip():
                continue
            if not check:
                yield number, json.loads(raw)
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _fail(
                    path, f"line {number} is not UTF-8 (byte {err.start} of the line)", "Save the file as UTF-8."
                ) from None
            if len(line) > max_row_chars:
                raise _too_long(path, f"line {number}", len(line), max_row_chars)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise _not_json_lines(path, number, line, err) from None
            yield number, row


def _check_row(path: Path, number: int, row: Any, max_row_chars: int) -> None:
    if not isinstance(row, dict):
        raise _fail(path, f"row {number} is a JSON {type(row).__name__}, not an object", "Make every row an object.")
    size = _row_chars(row)
    if size > max_row_chars:
        raise _too_long(path, f"row {number}", size, max_row_chars)


# --- CSV -----------------------------------------------------------------------------------------------------------


def _csv_columns(path: Path, max_row_chars: int) -> list[str]:
    """The header."""
    with _csv_reader(path, max_row_chars) as rows:
        header = _next_csv(path, rows, 0, max_row_chars)
    if header is None:
        raise _fail(path, "the CSV file has no header row", "Make the first row the column names.")
    return header


def _csv_second_pass(path: Path, columns: list[str], max_row_chars: int) -> Iterator[Row]:
    """Rows as ``{column: text}``, an empty field as missing (as a table reader has it)."""
    with _csv_reader(path, max_row_chars) as rows:
        header = _next_csv(path, rows, 0, max_row_chars) or []
        number = 0
        while (values := _next_csv(path, rows, number + 1, max_row_chars)) is not None:
            if not values:
                continue  # a blank line (not a row: a table reader skips it too)
            number += 1
            if len(values) > len(header):
                raise _fail(
                    path,
                    f"row {number} has {len(values)} fields, the header {len(header)}",
                    "Quote the fields that hold commas.",
                )
            size = sum(map(len, values))
            if size > max_row_chars:
                raise _too_long(path, f"row {number}", size, max_row_chars)
            named = dict(zip(header, values))
            yield {c: (named.get(c) or None) for c in columns}


class NotUtf8(ValueError):
    """A line of a CSV file that is not UTF-8: its number (from 1) and the first bad byte's offset in it."""

    def __init__(self, line: int, byte: int) -> None:
        super().__init__(f"line {line} is not UTF-8")
        self.line, self.byte = line, byte


class _csv_reader:
    """A ``csv.reader`` over the file (UTF-8, a byte-order mark allowed) whose fields may be as long as a row may;
    the module's field limit (a process-wide setting) is put back afterwards."""

    def __init__(self, path: Path, max_row_chars: int) -> None:
        self.path, self.limit = path, max_row_chars

    def __enter__(self) -> Iterator[list[str]]:
        self.handle = open(self.path, "rb")
        self.old = csv.field_size_limit(self.limit + 1)  # a field is never held longer than a row may be
        return csv.reader(self._lines())

    def _lines(self) -> Iterator[str]:
        """The file's lines as text, decoded one at a time: a byte that is not UTF-8 is named by its line
        (``NotUtf8``; a text decoder reading ahead would put it on the header)."""
        for number, raw in enumerate(self.handle, 1):
            try:
                yield (raw.removeprefix(BOM) if number == 1 else raw).decode("utf-8")
            except UnicodeDecodeError as err:
                raise NotUtf8(number, err.start) from None

    def __exit__(self, *exc: Any) -> None:
        csv.field_size_limit(self.old)
        self.handle.close()


def _next_csv(path: Path, rows: Iterator[list[str]], number: int, max_row_chars: int) -> list[str] | None:
    what = f"row {number}" if number else "the header"
    try:
        return next(rows)
    except StopIteration:
        return None
    except NotUtf8 as err:
        raise _fail(
            path,
            f"line {err.line} is not UTF-8 (byte {err.byte} of the line; a Windows-1252 or Latin-1 export?)",
            "Save the file as UTF-8 (e.g. iconv -f cp1252 -t utf-8 in.csv > out.csv).",
        ) from None
    except csv.Error as err:
        if "field larger than field limit" in str(err):
            raise _fail(
                path,
                f"{what} has a field over data.max-row-chars ({max_row_chars:,} characters)",
                "Split that document into several rows, close its quotes, or raise data.max-row-chars.",
            ) from None
        raise _fail(path, f"{what} cannot be read as CSV", f"The csv reader said: {err}.") from None


# --- Parquet and saved datasets ------------------------------------------------------------------------------------


def _parquet_columns(path: Path, max_row_chars: int) -> list[str]:
    try:
        return list(_parquet(path).schema_arrow.names)
    except OSError:
        raise
    except Exception as err:
        raise _refused(path, "parquet", err) from None


def _parquet_second_pass(path: Path, columns: list[str], max_row_chars: int) -> Iterator[Row]:
    try:
        batches = _parquet(path).iter_batches(batch_size=BATCH_ROWS)
        yield from _checked(path, (row for batch in batches for row in batch.to_pylist()), columns, max_row_chars)
    except (OSError, DataError):
        raise
    except Exception as err:
        raise _refused(path, "parquet", err) from None


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path)


def _refused(path: Path, reader: str, err: Exception) -> DataError:
    """A reader's own error: its kind for the server, its words (which may quote the file) for the operator."""
    return DataError(
        f"the {reader} reader refused the file ({type(err).__name__})",
        f"{path}: the {reader} reader refused it: {str(err)[:300]}. Every row must have the same columns with the "
        "same kinds of values.",
    )


def _checked(path: Path, rows: Iterable[Row], columns: list[str], max_row_chars: int) -> Iterator[Row]:
    for number, row in enumerate(rows, 1):
        size = _row_chars(row)
        if size > max_row_chars:
            raise _too_long(path, f"row {number}", size, max_row_chars)
        yield {c: row.get(c) for c in columns}


def _saved_dataset(path: Path, max_row_chars: int) -> _Rows:
    """A ``save_to_disk`` directory: its Arrow files memory-mapped in place (``load_from_disk`` copies nothing)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except OSError:
        raise
    except Exception as err:
        raise _fail(
            path,
            "the directory is not a saved dataset",
            f"Give a file, or a directory written by save_to_disk ({err}).",
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                "the saved DatasetDict has no 'train' split",
                f"{path}: the saved DatasetDict has no 'train' split (it has {sorted(loaded)}). Save one split.",
            )
        loaded = loaded["train"]
    table = loaded

    def rows() -> Iterator[Row]:
        def each() -> Iterator[Row]:
            for batch in table.iter(batch_size=BATCH_ROWS):
                keys = list(batch)
                for values in zip(*(batch[k] for k in keys)):
                    yield dict(zip(keys, values))

        yield from _checked(path, each(), list(table.column_names), max_row_chars)

    return _Rows(list(table.column_names), rows)


_FIRST_PASS: dict[str, Callable[[Path, int], list[str]]] = {
    "json": _json_columns,
    "csv": _csv_columns,
    "parquet": _parquet_columns,
}
_SECOND_PASS: dict[str, Callable[[Path, list[str], int], Iterator[Row]]] = {
    "json": _json_second_pass,
    "csv": _csv_second_pass,
    "parquet": _parquet_second_pass,
}


# --- rows -> examples ----------------------------------------------------------------------------------------------


def read_file(
    path: str | Path, fmt: str = "auto", max_prompt_chars: int = 400, max_row_chars: int = 200_000, strict: bool = True
) -> FileData:
    """Every row of the file as an ``Example``. ``fmt``: one of ``FORMATS``, or ``auto`` (from the columns).
    ``strict``: the first bad row is a DataError (a node refuses data it cannot read whole); False (the ``check``
    command): bad rows are listed in ``problems`` (the first 10) and left out. A file or folder this user cannot
    read is a DataError too (its kind, no path, in the message)."""
    path = Path(path).expanduser()
    try:
        return _read(path, fmt, max_prompt_chars, max_row_chars, strict)
    except OSError as err:  # e.g. PermissionError: its message is the path, which stays in the detail
        raise _unreadable(path, err) from None


def _read(path: Path, fmt: str, max_prompt_chars: int, max_row_chars: int, strict: bool) -> FileData:
    source = _rows(path, max_row_chars)
    if fmt == "auto":
        try:
            fmt = detect_format(source.columns)
        except DataError as err:
            raise DataError(str(err), f"{path}: {err.detail}") from None
    elif fmt not in FORMATS:
        raise _fail(path, f"unknown data format {fmt!r}", f"Name one of {list(FORMATS)}, or 'auto'.")
    out = FileData(fmt, [])
    for number, row in enumerate(source.rows(), 1):
        try:
            example, clipped = to_example(row, fmt, max_prompt_chars)
        except RowError as err:
            reason = f"row {number}: {err} (format {fmt})"
            problem = DataError(reason, f"{path}: {reason}{err.seen}. {_row_fix(fmt)}")
            if strict:
                raise problem from None
            out.refused += 1
            if len(out.problems) < 10:
                out.problems.append(problem.detail)
            continue
        out.examples.append(example)
        out.clipped += clipped
    if not out.examples:  # the first row's own reason, as a node reading the file strictly would give it
        first = f"; row 1 of them: {out.problems[0].removeprefix(f'{path}: ')}" if out.problems else ""
        raise _fail(path, f"no row could be read as {fmt}", f"{_row_fix(fmt)}{first}")
    return out


def _row_fix(fmt: str) -> str:
    return f"In the {fmt} format {HINTS[fmt]}; or name another format with data-format."
