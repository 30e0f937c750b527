"""JSON from files and messages that someone else may have written (a shared cache's records and pins, the cache's
config.json, state files, a safetensors header, a worker's message): nesting is bounded, so a hostile document is a
ValueError like any other malformed one, never a RecursionError here or in whatever walks the value later."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 200  # deeper than anything neuronbuild writes; far below the interpreter's recursion limit (1,000)


class TooDeep(ValueError):
    """A JSON document nested deeper than allowed."""


def loads(data: bytes | bytearray | str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads that refuses a document nested deeper than `max_depth` (TooDeep, a ValueError)."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise TooDeep(f"JSON nested deeper than {max_depth} levels") from None
    if isinstance(value, dict | list) and too_deep(value, max_depth):
        raise TooDeep(f"JSON nested deeper than {max_depth} levels")
    return value


def too_deep(value: Any, max_depth: int = MAX_DEPTH) -> bool:
    """Whether a parsed JSON value nests deeper than `max_depth` (an explicit stack: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
