"""Task fingerprints, shared by ATLAS and MIRA: the client computes them (``client.py``, math in ``gradients.py``),
the server reads and reduces them per base-model family (``server.py``, ``pca.py``); ``wire.py`` names what the
report carries; ``config.py`` is the ``fingerprint.*`` section."""

from .client import FingerprintClient
from .config import FingerprintSection
from .server import FingerprintReport, FingerprintStrategy, read_fingerprint

__all__ = ["FingerprintClient", "FingerprintReport", "FingerprintSection", "FingerprintStrategy", "read_fingerprint"]
