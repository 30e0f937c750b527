"""The user-facing error raised by toolchain steps (bad entry, missing factory, weight or input mismatch)."""

from __future__ import annotations

import os


class ToolchainError(Exception):
    """A mistake in the user's model, weights or spec; the message is one line and needs no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def source_frame(e: BaseException, sandbox: str | os.PathLike[str]) -> str:
    """Where in the action's own files (the model's sources, at their workspace paths in the sandbox) an exception
    was raised: `models/cnn.py:20` for the innermost such frame of its traceback, "" when none is."""
    import traceback

    prefix = os.path.realpath(sandbox) + os.sep
    found = ""
    for fr in traceback.extract_tb(e.__traceback__):
        name = os.path.realpath(fr.filename) if os.path.isabs(fr.filename) else fr.filename
        if name.startswith(prefix):
            found = f"{name[len(prefix):]}:{fr.lineno}"
    return found


def workspace_paths(text: str, sandbox: str | os.PathLike[str]) -> str:
    """`text` with the sandbox's absolute paths made workspace-relative (the sandbox holds files at those paths)."""
    for base in dict.fromkeys((os.fspath(sandbox), os.path.realpath(sandbox))):
        text = text.replace(base.rstrip(os.sep) + os.sep, "")
    return text
