"""The user-facing error raised by toolchain steps (bad entry, missing factory, weight or input mismatch)."""

from __future__ import annotations


class ToolchainError(Exception):
    """A mistake in the user's model, weights or spec; the message is one line and needs no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
