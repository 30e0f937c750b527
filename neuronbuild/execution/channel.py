"""Data-only messages between processes of different trust: the build process and its workers, a worker and the
per-action child that runs model code (worker.py), a Dask worker's pool and its workers.

Each message is one JSON document framed as multiprocessing.connection frames it (a length, then the bytes): never
pickle, since unpickling runs whatever the sender asks for and the sender may have run model code. A message that is
too long, not JSON, nested too deep or of the wrong shape raises BadMessage, which the reader treats as the failure of
the action it was waiting for."""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import Any

from neuronbuild import jsondata

# An action's result is small (its metadata and an error's first lines); a task message holds a spec.
MAX_MESSAGE = 64 << 20


class BadMessage(Exception):
    """A message that is not a well-formed, data-only message."""


def send(conn: Connection, msg: Any) -> None:
    """Send `msg` (JSON data: dicts, lists, strings, numbers, booleans, None; anything else is sent as its str)."""
    conn.send_bytes(json.dumps(msg, separators=(",", ":"), default=str).encode())


def recv(conn: Connection, maxlength: int = MAX_MESSAGE) -> Any:
    """The next message: a dict, or None (a stop). EOFError when the sender is gone; BadMessage when what arrived is
    not a message (then the connection is out of step and must not be read again)."""
    try:
        data = conn.recv_bytes(maxlength)
    except EOFError:
        raise
    except OSError as e:  # a frame longer than maxlength, or a broken frame
        raise BadMessage(f"an unreadable message ({e})") from None
    try:
        msg = jsondata.loads(data)
    except jsondata.TooDeep as e:
        raise BadMessage(f"a message {str(e).removeprefix('JSON ')}") from None
    except (ValueError, RecursionError) as e:
        raise BadMessage(f"a message that is not JSON ({type(e).__name__})") from None
    if msg is not None and not isinstance(msg, dict):
        raise BadMessage(f"a message that is a {type(msg).__name__}, not an object")
    return msg
