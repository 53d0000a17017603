"""The formats people already have, as rows -> ``Example``: detected from the columns or named.

- ``prompt-completion``: ``prompt`` and ``completion`` (or ``answer``, the built-in banks' name for it);
- ``alpaca``: ``instruction``, optional ``input``, ``output``;
- ``chat``: OpenAI-style ``messages``, a list of ``{"role": "system" | "user" | "assistant", "content": ...}``;
- ``sharegpt``: ``conversations``, a list of ``{"from": "system" | "human" | "gpt", "value": ...}``.

A ``task`` column, where a file has one, names each row's task. Every error names the row (counted from 1, the
line of a JSONL file) and the field, never the row's text: ``DataError``'s message may reach the server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from .example import ROLES, DataError, Example

FORMATS = ("prompt-completion", "alpaca", "chat", "sharegpt")
DEFAULT_TASK = "data"
# ShareGPT speakers -> chat roles (several exports use these names)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
HINTS = {
    "prompt-completion": "each row needs 'prompt' and 'completion' (or 'answer')",
    "alpaca": "each row needs 'instruction' and 'output' ('input' is optional)",
    "chat": "each row needs 'messages': a list of {'role', 'content'} with at least one assistant turn",
    "sharegpt": "each row needs 'conversations': a list of {'from', 'value'} with at least one 'gpt' turn",
}


def detect_format(columns: list[str]) -> str:
    """The format the columns say (their names in any case: ``Prompt,Completion`` is prompt-completion), or a
    DataError listing what each format needs."""
    names = {str(c).strip().lower() for c in columns}
    if not names:
        raise DataError("the file holds no rows", "the file holds no rows (it is empty, or only blank lines)")
    if "messages" in names:
        return "chat"
    if "conversations" in names:
        return "sharegpt"
    if {"instruction", "output"} <= names:
        return "alpaca"
    if "prompt" in names and names & {"completion", "answer"}:
        return "prompt-completion"
    raise DataError(  # the columns are the member's own names: only their number may leave the node
        f"cannot tell the format from the file's {len(names)} column(s): none is what a format needs",
        f"cannot tell the format from the columns {sorted(names)[:12]}: {'; '.join(HINTS.values())}. Rename the "
        "columns, or name the format with data-format (node config) or data.format (run config)",
    )


class RowError(DataError):
    """A row its format cannot read (what is wrong, as ``field``: ``reason``); the caller adds the file and row.
    ``seen``: what the row held there (its text), for the node's operator only (``DataError.detail``)."""

    def __init__(self, field: str, reason: str, seen: str = "") -> None:
        super().__init__(f"field '{field}' {reason}")
        self.field = field
        self.seen = seen


def _text(row: Mapping[str, Any], field: str, required: bool = True) -> str:
    value = row.get(field)
    if isinstance(value, list) and field == "content":  # OpenAI's content parts: the text ones, in order
        value = _text_parts(value)
    if value is None or (isinstance(value, float) and math.isnan(value)):  # CSV readers give NaN for a blank
        if required:
            raise RowError(field, "is missing")
        return ""
    if isinstance(value, bool | int | float):  # CSV readers make numbers of numeric answers
        return str(value)
    if not isinstance(value, str):
        raise RowError(field, f"must be text, not {type(value).__name__}")
    return value


def _text_parts(parts: list[Any]) -> str:
    """OpenAI content parts (``[{"type": "text", "text": ...}, ...]``) as one text; a part that is not text (an
    image, audio) cannot be trained on and is refused, naming its type."""
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowError(
                f"content[{i}]", "must be a text part ({'type': 'text', 'text': ...})", f" (got {str(kind)[:40]!r})"
            )  # the part's type is the member's data: only its own log sees it
        texts.append(part["text"])
    return "\n".join(texts)


def _answer(text: str, field: str) -> str:
    if not text.strip():
        raise RowError(field, "is empty: there is nothing to learn")
    return text


def _prompt_completion(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    field = "completion" if row.get("completion") is not None or "answer" not in row else "answer"
    return [("user", _text(row, "prompt")), ("assistant", _answer(_text(row, field), field))]


def _alpaca(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    instruction, extra = _text(row, "instruction"), _text(row, "input", required=False)
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [("user", prompt), ("assistant", _answer(_text(row, "output"), "output"))]


def _turns(row: Mapping[str, Any], field: str, role_key: str, text_key: str, roles: Mapping[str, str]):
    turns = row.get(field)
    if turns is None:
        raise RowError(field, "is missing")
    if not isinstance(turns, list) or not turns:
        raise RowError(field, "must be a non-empty list of turns")
    out: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise RowError(f"{field}[{i}]", f"must be an object with '{role_key}' and '{text_key}'")
        speaker = str(turn.get(role_key, "")).lower()
        if speaker not in roles:
            raise RowError(f"{field}[{i}].{role_key}", f"must be one of {sorted(roles)}", f" (got {speaker[:40]!r})")
        if text_key not in turn:
            raise RowError(f"{field}[{i}].{text_key}", "is missing")
        out.append((roles[speaker], _text(turn, text_key)))
    while out and out[-1][0] != "assistant":  # a trailing question has no answer to learn
        out.pop()
    if not out or not any(content.strip() for role, content in out if role == "assistant"):
        raise RowError(field, "has no assistant turn with text: there is nothing to learn")
    return out


def _chat(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    return _turns(row, "messages", "role", "content", {r: r for r in ROLES})


def _sharegpt(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    return _turns(row, "conversations", "from", "value", SHAREGPT_ROLES)


READERS: dict[str, Callable[[Mapping[str, Any]], list[tuple[str, str]]]] = {
    "prompt-completion": _prompt_completion,
    "alpaca": _alpaca,
    "chat": _chat,
    "sharegpt": _sharegpt,
}


def clip(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to about ``limit`` characters, and whether it was cut. The middle goes (" ... " marks it): a
    prompt's start (the instruction) and its end (the question) both stay."""
    if len(text) <= limit:
        return text, False
    head = text[: limit // 2].rsplit(" ", 1)[0]
    tail = text[len(text) - limit // 2 :].split(" ", 1)[-1]
    return f"{head} ... {tail}", True


def to_example(row: Mapping[str, Any], fmt: str, max_prompt_chars: int) -> tuple[Example, bool]:
    """One row as an ``Example`` (RowError if its format cannot read it), and whether a prompt or system turn was
    cut to ``max_prompt_chars`` (answers are never cut here: the token limit keeps their start)."""
    row = _lower_keys(row)
    turns = READERS[fmt](row)
    task = row.get("task")
    task = str(task) if isinstance(task, str | int) and str(task).strip() else DEFAULT_TASK
    clipped = False
    kept: list[tuple[str, str]] = []
    for role, content in turns:
        if role != "assistant":
            content, cut = clip(content, max_prompt_chars)
            clipped |= cut
        kept.append((role, content))
    return _example(task, kept, _example(task, turns).content_key() if clipped else ""), clipped


def _lower_keys(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row with its column names in lower case (the first of two that differ only in case wins), as
    ``detect_format`` reads them; the row itself where they already are."""
    if all(not isinstance(k, str) or k == k.strip().lower() for k in row):
        return row
    out: dict[str, Any] = {}
    for key, value in row.items():
        out.setdefault(key.strip().lower() if isinstance(key, str) else key, value)
    return out


def _example(task: str, turns: list[tuple[str, str]], source_key: str = "") -> Example:
    last = max(i for i, (role, _) in enumerate(turns) if role == "assistant")
    prompt = turns[last - 1][1] if last > 0 and turns[last - 1][0] == "user" else ""
    single = len(turns) == 2 and turns[0][0] == "user"
    return Example(task, prompt, turns[last][1], () if single else tuple(turns), source_key)
