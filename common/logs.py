"""One log format for the ServerApp and ClientApp processes (Flower's own logger is left alone)."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """A logger that prints ``HH:MM:SS name LEVEL message`` once, whatever process (Ray actor, SuperExec) it is in."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"))
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
