"""What the ServerApp and the ClientApp share. Importing it first keeps bitsandbytes' expected start-up warning
(see ``common.logs.silence_expected_warnings``) out of every process's log."""

from .logs import silence_expected_warnings

silence_expected_warnings()
