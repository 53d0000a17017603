"""One log format for the ServerApp and ClientApp processes (Flower's own logger is left alone)."""

from __future__ import annotations

import logging
import re

# what a message must not carry into a log line: line breaks (a member's text could forge lines of its own),
# escapes that drive a terminal, and every other control character
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with every control character written as its escape (``\\n``, ``\\x1b``): one line, inert."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class OneLineFormatter(logging.Formatter):
    """Every message on one line of printable text, whatever its arguments hold (a member's error reason, a file
    name); a traceback (``exc_info``) is printed below it as Python formats it."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.msg, record.args
        record.msg, record.args = one_line(record.getMessage()), None
        try:
            return super().format(record)
        finally:
            record.msg, record.args = saved


def get_logger(name: str) -> logging.Logger:
    """A logger that prints ``HH:MM:SS name LEVEL message`` once, whatever process (Ray actor, SuperExec) it is in."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(OneLineFormatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class _DropExpectedBnbWarning(logging.Filter):
    """bitsandbytes warns when imported on an AVX512-BF16 CPU that the optional ``kernels`` package could not
    fetch ``gemm_4bit_forward`` from the hub. Offline that is expected: it then uses the kernel it ships."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in record.getMessage()


def silence_expected_warnings() -> None:
    """Drop the expected start-up warning above; to work it must run before bitsandbytes is imported."""
    target = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropExpectedBnbWarning) for f in target.filters):
        target.addFilter(_DropExpectedBnbWarning())
