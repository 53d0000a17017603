"""One training example, whatever format it came from, and the errors bad data gets.

Every format (the built-in banks, prompt-completion, Alpaca, chat ``messages``, ShareGPT) becomes an ``Example``:
a conversation that ends with the assistant turn to learn. Single-turn data keeps ``turns`` empty and is read as
``user: prompt`` / ``assistant: answer``; a multi-turn conversation keeps every turn (system, user and assistant)
in ``turns``, and the loss is on each of its assistant turns (``common.training.encode``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    """A conversation ending with an assistant turn.

    task: the task it belongs to (the built-in banks' task name, a file's ``task`` column, else ``data``).
    prompt, answer: the last user turn and the last assistant turn (what generation is scored on).
    turns: the whole conversation as (role, content) pairs when it is more than one user and one assistant turn
    (a system message, several turns); empty for single-turn data.
    """

    task: str
    prompt: str
    answer: str
    turns: tuple[tuple[str, str], ...] = ()
    # the content_key of the example as its source wrote it, before any prompt was cut to data.max-prompt-chars (so
    # that a run with another limit puts it in the same split); "": the text as it is
    source_key: str = field(default="", compare=False, repr=False)

    def messages(self) -> list[dict[str, str]]:
        """The conversation in the chat-template form ``[{"role": ..., "content": ...}, ...]``."""
        pairs = self.turns or (("user", self.prompt), ("assistant", self.answer))
        return [{"role": role, "content": content} for role, content in pairs]

    def content_key(self) -> str:
        """What makes two examples the same: every turn's role and text, case and spacing aside (so a copy with
        other line breaks, or the same pair in another format, is the same example). The task is not part of it, and
        nor is a cut made to ``data.max-prompt-chars`` (``source_key``)."""
        if self.source_key:
            return self.source_key
        pairs = self.turns or (("user", self.prompt), ("assistant", self.answer))
        return "\x1e".join(f"{role}\x1f{' '.join(content.split()).casefold()}" for role, content in pairs)


def content_hash(example: Example, salt: str = "") -> int:
    """A 64-bit hash of ``example.content_key()`` (sha256: the same in every process, on every machine)."""
    digest = hashlib.sha256(f"{salt}\x1d{example.content_key()}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


class DataError(ValueError):
    """Data a node cannot use. ``str(err)`` is what may leave the node (the reason, a row number, a field name:
    never a path or a row's text); ``detail`` is the whole message for the node's operator (the file, the row, the
    fix), logged on the node and printed by ``python -m common.data check``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.detail = detail or reason
