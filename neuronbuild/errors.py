"""Error types shared by every phase, and the source locations they carry."""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_BUILD_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 8


@dataclass(frozen=True)
class Location:
    """A place in a BUILD or .bzl file; `path` is workspace-relative (or a label for .bzl files)."""

    path: str
    line: int = 1
    col: int = 1

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


class NeuronBuildError(Exception):
    """Base class: an error reported to the user as one line."""

    exit_code = EXIT_BUILD_FAILED

    def __init__(self, message: str, location: Location | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        if self.location is not None:
            return f"{self.location}: error: {self.message}"
        return f"error: {self.message}"


class UserInputError(NeuronBuildError):
    """Bad BUILD input or bad command line: exit code 2."""

    exit_code = EXIT_BAD_INPUT
