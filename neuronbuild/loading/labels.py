"""Labels (`//pkg:name`, `:name`, `@neuronbuild//rules:x.bzl`) and target patterns (`//...`, `//pkg/...`, `//pkg:all`)."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

_PKG_RE = re.compile(r"^[A-Za-z0-9_\-.]+(/[A-Za-z0-9_\-.]+)*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_\-.+=,@~]+(/[A-Za-z0-9_\-.+=,@~]+)*$")
BUILTIN_REPO = "neuronbuild"
MAX_NAME = 200  # characters in a target name (it becomes directory and file names under neuronbuild-out/)


class LabelError(ValueError):
    """A label or pattern that does not parse; the message is user-facing."""


@dataclass(frozen=True, order=True)
class Label:
    """A fully qualified label. repo is "" for the main workspace, "neuronbuild" for the shipped rules."""

    package: str
    name: str
    repo: str = ""

    @cached_property
    def _text(self) -> str:
        return f"@{self.repo}//{self.package}:{self.name}" if self.repo else f"//{self.package}:{self.name}"

    def __str__(self) -> str:
        return self._text

    @cached_property
    def _crc(self) -> int:
        """The hash: made once per object (dict and set keys in loading and analysis, 100,000s of lookups at scale),
        from the fields only, the same in every process (the value travels with a pickled label, e.g. to a Dask
        worker)."""
        return zlib.crc32(f"{self.repo}//{self.package}:{self.name}".encode())

    def __hash__(self) -> int:
        return self._crc

    @property
    def path(self) -> str:
        """Workspace-relative path of a file label (e.g. a .bzl file)."""
        return f"{self.package}/{self.name}" if self.package else self.name


def json_value(v: Any) -> Any:
    """An attribute value as JSON: labels as canonical strings, tuples as lists (a BUILD file's dicts keep their
    order)."""
    if isinstance(v, Label):
        return str(v)
    if isinstance(v, (tuple, list)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    return v


# Package and target names found valid (a pure check; the same names recur in 100,000s of labels at scale)
_VALID_PACKAGES: set[str] = set()
_VALID_NAMES: set[str] = set()
_VALID_MAX = 1 << 17


def _check_package(pkg: str, text: str) -> None:
    if pkg in _VALID_PACKAGES:
        return
    if pkg and (not _PKG_RE.match(pkg) or any(p in ("..", ".") for p in pkg.split("/"))):
        raise LabelError(f"invalid package name in label '{text}'")
    if len(_VALID_PACKAGES) >= _VALID_MAX:
        _VALID_PACKAGES.clear()
    _VALID_PACKAGES.add(pkg)


def _check_name(name: str, text: str) -> None:
    if name in _VALID_NAMES:
        return
    if not name or not _NAME_RE.match(name) or any(p in ("..", ".") for p in name.split("/")):
        raise LabelError(f"invalid target name in label '{text}'")
    if len(name) > MAX_NAME:
        raise LabelError(f"target name in label '{text[:60]}...' is {len(name)} characters long (the limit is {MAX_NAME})")
    if len(_VALID_NAMES) >= _VALID_MAX:
        _VALID_NAMES.clear()
    _VALID_NAMES.add(name)


def check_target_name(name: str) -> None:
    """A rule's `name` must be usable as the name part of a label (and so as a directory name): LabelError if not."""
    if name in (".", "..") or "/" in name:
        raise LabelError(f"invalid target name {name!r}: '.', '..' and '/' are not allowed")
    _check_name(name, f":{name}")


_PARSED: dict[tuple[str, str], Label] = {}  # parse_label's answers (a pure function; labels repeat 100,000s of times)
_PARSED_MAX = 1 << 17  # (~30 MiB at most: a 100,000-graph workspace has ~80,000 distinct)


def parse_label(text: str, current_package: str) -> Label:
    """Parse `text` relative to `current_package` (for `:name` and bare `name`)."""
    if type(text) is str and type(current_package) is str:
        known = _PARSED.get((text, current_package))
        if known is not None:
            return known
        lbl = _parse_label(text, current_package)
        lbl = _intern(lbl)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[(text, current_package)] = lbl
        return lbl
    return _parse_label(text, current_package)


# One Label object per label (while at most _PARSED_MAX are known): `//p:m` and `:m` in package p parse to the same
# object, so the dicts and sets keyed by labels in loading and analysis find it by identity (the dataclass's __eq__,
# a Python call, is not run; ~100,000s of lookups at 100,000 graphs).
_CANONICAL: dict[tuple[str, str, str], Label] = {}


def canonical_label(package: str, name: str, repo: str = "") -> Label:
    """Label(package, name, repo): the one object this process made for it (an equal, valid label)."""
    lbl = _CANONICAL.get((package, name, repo))
    return lbl if lbl is not None else _intern(Label(package, name, repo))


def _intern(lbl: Label) -> Label:
    """The object kept for `lbl`'s label (`lbl` itself if none was)."""
    key = (lbl.package, lbl.name, lbl.repo)
    known = _CANONICAL.get(key)
    if known is None:
        if len(_CANONICAL) >= _PARSED_MAX:
            _CANONICAL.clear()
        known = _CANONICAL[key] = lbl
    return known


def _parse_label(text: str, current_package: str) -> Label:
    if not isinstance(text, str) or not text:
        raise LabelError(f"invalid label {text!r}")
    repo = ""
    rest = text
    if rest.startswith("@"):
        if "//" not in rest:
            raise LabelError(f"invalid label '{text}': expected @repo//pkg:name")
        repo, rest = rest[1:].split("//", 1)
        rest = "//" + rest
        if repo != BUILTIN_REPO:
            raise LabelError(f"unknown repository '@{repo}' in label '{text}' (only @{BUILTIN_REPO} is known)")
    if rest.startswith("//"):
        body = rest[2:]
        if ":" in body:
            pkg, name = body.split(":", 1)
        else:
            pkg = body
            name = body.rsplit("/", 1)[-1]
            if not pkg:
                raise LabelError(f"invalid label '{text}': the root package needs an explicit ':name'")
    elif rest.startswith(":"):
        pkg, name = current_package, rest[1:]
    else:
        if ":" in rest:
            raise LabelError(f"invalid label '{text}': did you mean '//{rest}'?")
        pkg, name = current_package, rest
    _check_package(pkg, text)
    _check_name(name, text)
    return Label(pkg, name, repo)


@dataclass(frozen=True)
class TargetPattern:
    """`//pkg:name` (one target), `//pkg:all` / `//pkg:*` (a package), `//pkg/...` (a package tree)."""

    package: str
    name: str | None  # None: every target in the package(s)
    recursive: bool = False

    def __str__(self) -> str:
        if self.recursive:
            return f"//{self.package}/..." if self.package else "//..."
        return f"//{self.package}:{self.name or 'all'}"

    def matches_package(self, package: str) -> bool:
        if self.recursive:
            return not self.package or package == self.package or package.startswith(self.package + "/")
        return package == self.package


def parse_pattern(text: str, cwd_package: str = "") -> TargetPattern:
    """Parse a command-line target pattern; relative patterns are taken against `cwd_package`."""
    raw = text
    if not text.startswith("//"):
        if text.startswith(":"):
            text = f"//{cwd_package}{text}"
        else:
            text = f"//{cwd_package}/{text}" if cwd_package else f"//{text}"
    body = text[2:]
    if body == "..." or body.endswith("/..."):
        pkg = body[:-3].rstrip("/")
        _check_package(pkg, raw)
        return TargetPattern(pkg, None, True)
    if ":" in body:
        pkg, name = body.split(":", 1)
        _check_package(pkg, raw)
        if name in ("all", "*", "all-targets"):
            return TargetPattern(pkg, None, False)
        _check_name(name, raw)
        return TargetPattern(pkg, name, False)
    lbl = parse_label(text, cwd_package)
    return TargetPattern(lbl.package, lbl.name, False)
