"""What the ServerApp and the ClientApp share. Importing it first keeps bitsandbytes' expected start-up warning
(see ``common.logs.silence_expected_warnings``) out of every process's log, and its import from compiling helpers
nobody calls (``common.bnb_import``: about 1.4 s of CPU a process)."""

from .bnb_import import defer_bitsandbytes_compile
from .logs import silence_expected_warnings

silence_expected_warnings()
defer_bitsandbytes_compile()
