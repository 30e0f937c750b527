"""A persistent cache of evaluated packages: a BUILD file is not evaluated again while it and every .bzl it load()ed
(transitively) have the same contents, and the source files its targets name still exist.

Starlark evaluation is hermetic (no clock, environment or file access besides the natives), so a package's targets are a
function of those files' contents and of neuronbuild's own code (the cache is keyed by `self_stamp.code_stamp()`).
Contents are compared by BLAKE3 digest through the stat-keyed digest cache, so unchanged files are not even read.
Only successful loads are cached; errors always come from a fresh evaluation. `print()` output of a BUILD file is shown
when it is evaluated, not when its package comes from this cache.

The file is data only (JSON), and a shared cache is untrusted: it is read only when this user wrote it (not group- or
world-writable), every cached target is validated again against its rule schema, exactly as a rule call in a BUILD
file is, and anything that does not fit makes the whole file a miss. Nothing in it can run code."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.digests import digest_file, is_racy, stat_key
from neuronbuild.engine import Engine, Node
from neuronbuild.errors import Location, UserInputError
from neuronbuild.loading.labels import Label, LabelError, json_value, parse_label
from neuronbuild.loading.loader import Loader, validate_rule
from neuronbuild.loading.schema import RULES
from neuronbuild.loading.targets import Package, Target
from neuronbuild.plugin_api.rules import AttrError
from neuronbuild.self_stamp import code_stamp

_FORMAT = "nb-load-cache-2"
MAX_BYTES = 1 << 30  # a state file larger than this is not read (a miss)


@dataclass(frozen=True)
class _Entry:
    """A cached package: the digest of every file that went into it, and its targets as plain tuples."""

    digests: tuple[tuple[str, str], ...]  # (display, digest) for the BUILD file and each loaded .bzl
    build_file: str
    targets: tuple[tuple[Any, str, dict[str, Any], str, int], ...]  # label, kind, attrs, build_file, index
    files: tuple[str, ...]

    @cached_property
    def sources(self) -> tuple[tuple[Label, str], ...]:
        """(label, attribute) of every source file the entry's targets name, in order (listed once per entry)."""
        out: list[tuple[Label, str]] = []
        for _label, kind, attrs, _build_file, _index in self.targets:
            for name in _file_attrs(kind):
                v = attrs.get(name)
                if v is not None:
                    out.extend((lbl, name) for lbl in (v if isinstance(v, tuple) else (v,)))
        return tuple(out)


def cache_file(cache_base: Path, root: Path) -> Path:
    """Where the load cache of workspace `root` lives inside the build cache directory."""
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:20]
    return cache_base / "v1" / "state" / f"load-{key}.json"


class _Key(tuple):  # type: ignore[type-arg]
    """A loading engine key: (its class, a name or path: key[1]). A tuple, so it is made, hashed and compared in C
    (two per package per load: 10,000s at scale); keys of two classes never compare equal."""

    __slots__ = ()

    def __new__(cls, text: str) -> Any:
        return tuple.__new__(cls, (cls, text))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self[1]!r})"


class PackageKey(_Key):
    """A package's load in the loading engine: (entry, Package), current while `LoadCache.current(entry)`."""


class ListingKey(_Key):
    """A directory's listing (Loader.listing) in the loading engine: current while it was `reusable` and the
    directory's mtime is the one listed (creating, removing or renaming an entry changes it)."""

    def unchanged(self, node: Node) -> bool:
        v = node.value
        try:
            return v is not None and v[4] and os.stat(self[1]).st_mtime_ns == v[0]
        except OSError:
            return False

    def compute(self, _ctx: Engine) -> Any:
        return Loader.listing(self[1])


class LoadCache:
    """Evaluated packages of one workspace, reused while their inputs are unchanged; in a kept session (the build
    server), `engine` holds the packages and directory listings of every load as keys (PackageKey, ListingKey), this
    cache being PackageKey's function, bound to the loading running (`loader`). A recomputed package with the same
    entry keeps its Package object (`keep_equal`): analysis checks an unchanged Target by identity."""

    keep_equal = True

    def __init__(self, file: Path | None, keep: bool = False) -> None:
        self.file = file
        self._entries: dict[str, _Entry] = {}
        self._dirty = False
        self.hits = 0
        self.misses = 0
        self.engine = Engine({PackageKey: self}) if keep else None
        self.loader: Loader | None = None
        self.loaded: dict[str, Node] = {}  # (kept: this load's package nodes, by name; the graph check holds them)
        if file is not None:
            try:
                self._entries = _read(file)
            except (OSError, ValueError, TypeError, KeyError, LookupError, RecursionError, AttrError, LabelError):
                self._entries = {}  # an unreadable or hostile cache is an empty cache

    def _path(self, loader: Loader, display: str) -> Path | str:
        if display.startswith("@"):
            return loader._bzl_source(display, "", Location(display))[1]
        return f"{loader._root_text}/{display}"  # (= loader.root / display, without pathlib's cost)

    def begin(self, loader: Loader) -> None:
        """A new load by `loader`: the engine's next revision (every node is checked again before it is used)."""
        self.loader = loader
        self.loaded = {}
        if self.engine is not None:
            self.engine.advance()

    def listing(self, path: str) -> Any:
        """Loader.find_packages' listing of a directory (kept between loads: ListingKey)."""
        return Loader.listing(path) if self.engine is None else self.engine.get(ListingKey(path))

    def package(self, name: str) -> Package:
        """Package `name`: cached if its inputs are unchanged, else evaluated and cached (kept: PackageKey)."""
        if self.engine is None:
            return self.load(name)[1]
        node = self.engine.fresh(PackageKey(name))  # (no computation is running: nothing to record)
        assert node is not None
        self.loaded[name] = node
        return node.value[1]  # type: ignore[no-any-return]

    def compute(self, key: PackageKey, _ctx: Engine) -> tuple[_Entry | None, Package]:
        return self.load(key[1])

    @staticmethod
    def equal(old: tuple[_Entry | None, Package], new: tuple[_Entry | None, Package]) -> bool:
        return old[0] is not None and old[0] == new[0]

    def unchanged(self, _key: PackageKey, node: Node) -> bool:
        current = self.current(node.value[0])
        self.hits += current
        return current

    def current(self, e: _Entry | None) -> bool:
        """Whether every input file of entry `e` is unchanged and its source files exist (None: not cached)."""
        loader = self.loader
        assert loader is not None
        if e is None:
            return False
        try:
            known = loader.digests_now  # (a .bzl many packages load is digested once per load)
            for display, digest in e.digests:
                now = known.get(display)
                if now is None:
                    now = digest_file(self._path(loader, display))
                    if display.endswith(".bzl"):
                        known[display] = now
                if now != digest:
                    return False
            for lbl, name in e.sources:
                loader.check_source_file(lbl, name)
        except (OSError, LookupError, AttrError, UserInputError):
            return False
        return True

    def load(self, name: str) -> tuple[_Entry | None, Package]:
        """Package `name` from its entry if that is current, else evaluated (and cached if its files did not change
        meanwhile): with the entry it came from."""
        e = self._entries.get(name)
        if self.current(e):
            assert e is not None
            self.hits += 1
            return e, Package(name, e.build_file, tuple(Target(label, kind, MappingProxyType(attrs), build_file, index)
                                                        for label, kind, attrs, build_file, index in e.targets), e.files)
        self.misses += 1
        started = time.time_ns()
        assert self.loader is not None
        pkg = self.loader.load_package(name)
        return self.put(self.loader, pkg, started), pkg

    def put(self, loader: Loader, pkg: Package, started_ns: int) -> _Entry | None:
        """Remember a package evaluated after `started_ns` (time.time_ns()). Skipped if any of its files changed since
        shortly before then: the contents evaluated might not be the contents digested now."""
        try:
            paths = [self._path(loader, d) for d in pkg.files]
            if any(is_racy(stat_key(os.stat(p)), started_ns) for p in paths):
                return None
            digests = tuple((d, digest_file(p)) for d, p in zip(pkg.files, paths, strict=True))
        except (OSError, UserInputError):
            return None
        e = self._entries[pkg.name] = _Entry(digests, pkg.build_file, tuple(
            (t.label, t.kind, dict(t.attrs), t.build_file, t.index) for t in pkg.targets), pkg.files)
        self._dirty = True
        return e

    def save(self) -> None:
        """Write the cache atomically if anything changed (concurrent builds: the last writer wins; nothing breaks)."""
        if self.file is None or not self._dirty:
            return
        data = json.dumps({"format": _FORMAT, "code": code_stamp(),
                           "entries": {name: _encode(e) for name, e in self._entries.items()}},
                          separators=(",", ":"))  # not sorted: attribute dicts keep BUILD order (input order)
        atomic_write_bytes(self.file, data.encode(), self.file.parent, durable=False)  # a speed-up only: no fsync
        self._dirty = False


_FILE_ATTRS: dict[str, tuple[str, ...]] = {}


def _file_attrs(kind: str) -> tuple[str, ...]:
    """The attributes of a rule kind that name source files (checked to exist whenever a package is reused)."""
    names = _FILE_ATTRS.get(kind)
    if names is None:
        names = _FILE_ATTRS[kind] = tuple(a.name for a in RULES[kind].attrs if "file" in a.kinds)
    return names


def _encode(e: _Entry) -> dict[str, Any]:
    return {"digests": [list(d) for d in e.digests], "build_file": e.build_file, "files": list(e.files),
            "targets": [[str(label), kind, json_value(attrs), bf, index]
                        for label, kind, attrs, bf, index in e.targets]}


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("expected a string")
    return v


def _decode(name: str, raw: Any) -> _Entry:
    """One cached package read back, every target validated as a rule call is (raises on anything unexpected)."""
    if not isinstance(raw, dict):
        raise TypeError("entry")
    digests = tuple((_str(d), _str(g)) for d, g in raw["digests"])
    files = tuple(_str(f) for f in raw["files"])
    targets = []
    for label_text, kind, attrs, bf, index in raw["targets"]:
        if kind not in RULES or not isinstance(attrs, dict) or isinstance(index, bool) or not isinstance(index, int):
            raise TypeError("target")
        label = parse_label(_str(label_text), "")
        if label.package != name or label.repo or attrs.get("name") != label.name:
            raise ValueError("target outside its package")
        targets.append((label, kind, validate_rule(kind, attrs, name), _str(bf), index))
    if not files or digests[0][0] != files[0]:
        raise ValueError("files")
    return _Entry(digests, _str(raw["build_file"]), tuple(targets), files)


def _read(file: Path) -> dict[str, _Entry]:
    with open(file, "rb") as f:
        st = os.fstat(f.fileno())
        # Only this user's own file: another user's could hold valid targets that differ from the BUILD file.
        if st.st_size > MAX_BYTES or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return {}
        data = json.loads(f.read())
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("code") != code_stamp():
        return {}
    entries = data["entries"]
    if not isinstance(entries, dict):
        raise TypeError("entries")
    return {_str(name): _decode(name, raw) for name, raw in entries.items()}
