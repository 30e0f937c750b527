"""Pins: named sets of fingerprints and blob digests (e.g. a release bundle) that garbage collection never evicts.

A pin is the JSON file <cache>/v1/pins/<name>.json holding {"fingerprints": [...], "digests": [...]}; a pinned
fingerprint keeps its action record and every blob it references, a pinned digest keeps that blob."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from neuronbuild import jsondata
from neuronbuild.atomic import atomic_write_bytes

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class PinError(ValueError):
    """A bad pin name or an unreadable pin file (gc refuses to run rather than ignore it)."""


@dataclass(frozen=True)
class Pin:
    """One pin file's contents."""

    name: str
    fingerprints: frozenset[str]
    digests: frozenset[str]


def pins_dir(root: Path) -> Path:
    return root / "pins"


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise PinError(f"bad pin name '{name}' (letters, digits, '.', '_', '-'; at most 128 characters)")
    return name


def write_pin(root: Path, name: str, fingerprints: Iterable[str], digests: Iterable[str] = ()) -> Path:
    """Create or replace pin `name` (atomically)."""
    path = pins_dir(root) / f"{check_name(name)}.json"
    data = {"fingerprints": sorted(set(fingerprints)), "digests": sorted(set(digests))}
    atomic_write_bytes(path, json.dumps(data, indent=1).encode(), root / "tmp")
    return path


def remove_pin(root: Path, name: str) -> bool:
    path = pins_dir(root) / f"{check_name(name)}.json"
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def load_pins(root: Path) -> list[Pin]:
    """Every pin; raises PinError for a pin file that cannot be read, so nothing it protects is evicted."""
    out: list[Pin] = []
    d = pins_dir(root)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            data = jsondata.loads(p.read_bytes())
            fps = frozenset(str(x) for x in data.get("fingerprints", []))
            digests = frozenset(str(x) for x in data.get("digests", []))
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise PinError(f"{p}: unreadable pin file ({e})") from e
        out.append(Pin(p.stem, fps, digests))
    return out


def pinned(root: Path) -> tuple[set[str], set[str]]:
    """(fingerprints, digests) protected by all pins."""
    fps: set[str] = set()
    digests: set[str] = set()
    for pin in load_pins(root):
        fps |= pin.fingerprints
        digests |= pin.digests
    return fps, digests

