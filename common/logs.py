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
