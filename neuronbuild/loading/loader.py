"""Evaluates BUILD files and the .bzl files they load() into Packages of validated Targets."""

from __future__ import annotations

import ast
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from neuronbuild.digests import RACY_NS, StatMemo, stat_key
from neuronbuild.errors import Location, UserInputError
from neuronbuild.loading.labels import BUILTIN_REPO, Label, LabelError, canonical_label, check_target_name, parse_label
from neuronbuild.loading.schema import RULES, validate_call
from neuronbuild.loading.starlark_adapter import RESERVED_PREFIX, Frame, Interpreter, StarlarkFailure
from neuronbuild.loading.targets import Package, Target
from neuronbuild.plugin_api.rules import AttrError
from neuronbuild.workspace import BUILD_FILE, MARKER, OUTPUT_DIR, builtin_rules_dir


class _Trap(Exception):
    """Raised by a native on purpose to learn the call site of the n-th rule call."""


@dataclass(frozen=True)
class _LoadStmt:
    label: str
    symbols: tuple[tuple[str, str], ...]  # (local name, name in the .bzl)
    line: int
    col: int


@dataclass(frozen=True)
class _SourceFile:
    display: str  # the name used in messages and in Starlark's filename=
    path: Path
    text: str  # with load() lines blanked
    loads: tuple[_LoadStmt, ...]
    package: str  # package the file's relative labels resolve against
    defined: frozenset[str]
    used: tuple[tuple[str, int, int], ...]  # names read at any level: (name, line, col)
    stored: frozenset[str]


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEYWORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t]*=(?!=)")
# The attribute a rule-call error is about, as the messages name it.
_ATTR_IN_MESSAGE = re.compile(r"(?:attribute|got an unknown attribute) '([A-Za-z_][A-Za-z0-9_]*)")


def attr_location(text: str, call: Location, attr: str) -> Location:
    """Where `attr = ...` is written among the keyword arguments of the call whose '(' is at `call` (its own
    arguments, not nested calls'), else `call` itself. Strings and comments are skipped."""
    lines = text.split("\n")
    if not 1 <= call.line <= len(lines):
        return call
    start = sum(len(line) + 1 for line in lines[:call.line - 1]) + call.col - 1
    i = text.find("(", start)
    if i < 0 or text.count("\n", start, i):
        return call
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            i = text.find("\n", i)
            if i < 0:
                break
        elif c in "\"'":
            quote = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else c
            i += len(quote)
            while i < n and not text.startswith(quote, i):
                i += 2 if text[i] == "\\" else 1
            i += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                break
        elif depth == 1 and (c.isalpha() or c == "_"):
            kw = _KEYWORD.match(text, i)
            if kw and kw.group(1) == attr and text[:i].rstrip()[-1:] in ("(", ","):
                line = text.count("\n", 0, i) + 1
                return Location(call.path, line, i - (text.rfind("\n", 0, i) + 1) + 1)
            ident = _IDENT.match(text, i)
            i = ident.end() - 1 if ident else i
        i += 1
    return call


MAX_SOURCE_BYTES = 4 << 20  # BUILD/.bzl files larger than this are refused (parsing costs ~250x the file in memory)


def _parse_source(display: str, path: Path, package: str) -> _SourceFile:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)
    except OSError as e:
        raise UserInputError(f"cannot read file: {e.strerror or e}", Location(display)) from None
    if len(data) > MAX_SOURCE_BYTES:
        raise UserInputError(f"file is larger than {MAX_SOURCE_BYTES // (1 << 20)} MiB, the limit for BUILD and .bzl "
                             "files", Location(display))
    try:
        raw = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
    except UnicodeDecodeError:
        raise UserInputError("file is not valid UTF-8", Location(display)) from None
    if "\x00" in raw:
        at = raw.index("\x00")
        line = raw.count("\n", 0, at) + 1
        raise UserInputError("NUL byte in file", Location(display, line, at - raw.rfind("\n", 0, at)))
    try:
        tree = ast.parse(raw, filename=display)
    except (RecursionError, MemoryError):
        raise UserInputError("expressions nested too deeply", Location(display)) from None
    except SyntaxError as e:
        if "too many nested" in str(e.msg) or "too complex" in str(e.msg):
            raise UserInputError(f"expression nested too deeply ({e.msg})",
                                 Location(display, e.lineno or 1, e.offset or 1)) from None
        # Let Starlark produce the authoritative syntax error.
        interp = Interpreter({}, display)
        try:
            interp.exec(raw, display)
        except StarlarkFailure as e:
            raise UserInputError(f"syntax error: {e.message}", Location(display, e.line, e.col)) from None
        raise UserInputError("syntax error", Location(display)) from None
    for node in ast.walk(tree):  # starlark-go truncates strings at a NUL: refuse "\x00" escapes instead
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\x00" in node.value:
            raise UserInputError("NUL character in a string (starlark-go would silently truncate it)",
                                 Location(display, node.lineno, node.col_offset + 1))
    lines = raw.split("\n")
    loads: list[_LoadStmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "load":
            top = any(isinstance(s, ast.Expr) and s.value is node for s in tree.body)
            loc = Location(display, node.lineno, node.col_offset + 1)
            if not top:
                raise UserInputError("load() is only allowed as a top-level statement", loc)
            if not node.args or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args):
                raise UserInputError("load() takes a label and symbol names as string literals", loc)
            if len(node.args) < 2 and not node.keywords:
                raise UserInputError("load() must name at least one symbol to import", loc)
            syms: list[tuple[str, str]] = [(str(a.value), str(a.value)) for a in node.args[1:]]  # type: ignore[attr-defined]
            for kw in node.keywords:
                if kw.arg is None or not (isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)):
                    raise UserInputError("load() aliases must look like alias = \"symbol\"", loc)
                syms.append((kw.arg, kw.value.value))
            for local, _orig in syms:
                if not local.isidentifier():
                    raise UserInputError(f"load(): invalid symbol name '{local}'", loc)
            loads.append(_LoadStmt(str(node.args[0].value), tuple(syms), loc.line, loc.col))  # type: ignore[attr-defined]
            end = node.end_lineno or node.lineno
            for i in range(node.lineno - 1, end):
                lines[i] = ""
    defined: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef):
            defined.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        defined.add(n.id)
    used: list[tuple[str, int, int]] = []
    stored: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Name, ast.arg, ast.FunctionDef)):
            ident = n.id if isinstance(n, ast.Name) else n.arg if isinstance(n, ast.arg) else n.name
            if ident.startswith(RESERVED_PREFIX):  # the raw natives behind the NUL guard (starlark_adapter)
                raise UserInputError(f"name '{ident}' is reserved (names starting with {RESERVED_PREFIX} are "
                                     "neuronbuild's)", Location(display, n.lineno, n.col_offset + 1))
        if isinstance(n, ast.Name):
            if isinstance(n.ctx, ast.Load):
                used.append((n.id, n.lineno, n.col_offset + 1))
            else:
                stored.add(n.id)
        elif isinstance(n, ast.arg):
            stored.add(n.arg)
    return _SourceFile(display, path, "\n".join(lines), tuple(loads), package, frozenset(defined), tuple(used),
                       frozenset(stored))


_bzl_parses: StatMemo[_SourceFile] = StatMemo(20_000)


def _parse_bzl(display: str, path: Path, package: str) -> _SourceFile:
    """_parse_source for .bzl files, kept by the file's stat key: a macro file loaded by many BUILD files is parsed
    once per process (the parse is a frozen value; each BUILD file still executes it in its own interpreter)."""
    now = time.time_ns()
    key = stat_key(path.stat())
    hit = _bzl_parses.get(str(path), key)
    if hit is None or hit.display != display or hit.package != package:
        hit = _parse_source(display, path, package)
        _bzl_parses.put(str(path), key, hit, now)
    return hit


def validate_rule(kind: str, kwargs: dict[str, Any], package: str) -> dict[str, Any]:
    """validate_call plus what the loader adds: the name is a valid label name, labels of `own_package` attributes (a
    model's srcs) are in the target's package."""
    attrs = validate_call(kind, kwargs, package)
    try:
        check_target_name(attrs["name"])
    except LabelError as e:
        raise AttrError(str(e)) from None
    for name in RULES[kind].own_package_attrs:
        value = attrs.get(name)
        for lbl in value if isinstance(value, list | tuple) else [value] if value is not None else []:
            if getattr(lbl, "package", package) != package:
                raise AttrError(f"attribute '{name}': '{lbl}' is in package //{lbl.package}, not in this package "
                                f"(//{package}); a {kind}'s {name} must live in its own package")
    return attrs


class _PackageContext:
    """The natives one BUILD file's evaluation sees; records targets in call order."""

    def __init__(self, loader: Loader, package: str, build_file: str, trap_index: int | None = None) -> None:
        self.loader = loader
        self.package = package
        self.build_file = build_file
        self.trap_index = trap_index
        self.targets: dict[str, Target] = {}
        self.index = 0
        self.error: Exception | None = None
        self.files: set[str] = {build_file}
        self.natives: dict[str, Callable[..., Any]] = {kind: self._make_rule(kind) for kind in RULES}
        self.natives["package_name"] = self._package_name

    def _package_name(self) -> str:
        return self.package

    def _make_rule(self, kind: str) -> Callable[..., Any]:
        def rule(*args: Any, **kwargs: Any) -> None:
            try:
                try:
                    self._rule(kind, args, kwargs)
                except RecursionError:  # a value nested ~1,000 deep (built by a loop: the parser limits literals)
                    raise AttrError("an attribute value is nested too deeply") from None
            except Exception as e:  # noqa: BLE001 - re-raised with its location by the loader
                self.error = e
                raise
            return None

        return rule

    def _rule(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.index += 1
        if self.trap_index == self.index:
            raise _Trap()
        if args:
            raise AttrError(f"{kind}() takes keyword arguments only (got {len(args)} positional)")
        attrs = validate_rule(kind, kwargs, self.package)
        name = attrs["name"]
        if name in self.targets:
            raise AttrError(f"duplicate target name '{name}' in package '//{self.package}'")
        for a in RULES[kind].attrs:
            if "file" in a.kinds and attrs.get(a.name) is not None:
                vals = attrs[a.name] if isinstance(attrs[a.name], tuple) else (attrs[a.name],)
                for lbl in vals:
                    self.loader.check_source_file(lbl, a.name)
        label = canonical_label(self.package, name)
        self.targets[name] = Target(label, kind, MappingProxyType(attrs), self.build_file, self.index)


class Loader:
    """Loads packages of one workspace. Call only on the Starlark thread (see starlark_adapter.run_on_starlark_thread)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rules_dir = builtin_rules_dir()
        self._real_root: Path | None = None
        self._root_text = str(self.root)
        self._real_dirs: dict[str, str] = {}
        self.digests_now: dict[str, str] = {}  # display -> digest of the .bzl files checked by this loading

    # ---- files -------------------------------------------------------------------------------------------------------
    def build_file_path(self, package: str) -> Path:
        return self.root / package / BUILD_FILE if package else self.root / BUILD_FILE

    def has_package(self, package: str) -> bool:
        root = self._root_text  # (build_file_path(package).is_file() on strings: 5,000 packages per load)
        return os.path.isfile(f"{root}/{package}/{BUILD_FILE}" if package else f"{root}/{BUILD_FILE}")

    def check_source_file(self, label: Label, attr: str) -> None:
        if label.repo:
            raise AttrError(f"attribute '{attr}': source files must be in this workspace, not '{label}'")
        root = self._root_text
        path = f"{root}/{label.package}/{label.name}" if label.package else f"{root}/{label.name}"
        try:
            st = os.lstat(path)  # (a regular file, not a link: one call answers both questions below)
            plain = stat.S_ISREG(st.st_mode)
            regular = plain or stat.S_ISREG(os.stat(path).st_mode)  # (Path.is_file(): follows links)
        except (OSError, ValueError):
            regular = False
        if not regular:
            raise AttrError(f"attribute '{attr}': source file '{label.path}' does not exist")
        if self._real_root is None:
            self._real_root = self.root.resolve()
        real_root = str(self._real_root)
        real = self._real_path(path, plain)
        if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):  # (Path.relative_to of resolve())
            raise AttrError(f"attribute '{attr}': source file '{label.path}' points outside the workspace") from None

    def _real_path(self, path: str, plain: bool = False) -> str:
        """os.path.realpath(path) of an existing path (what Path.resolve() gives), with the real path of each
        directory kept for this loader (one loading: 5,000 packages' sources share their directories' prefixes).
        `plain`: the caller's lstat found a regular file (not a link)."""
        head, name = os.path.split(path)
        if not head or not name or (not plain and stat.S_ISLNK(os.lstat(path).st_mode)):
            return os.path.realpath(path)
        real_head = self._real_dirs.get(head)
        if real_head is None:
            real_head = self._real_dirs[head] = self._real_path(head)
        return os.path.join(real_head, name)

    def find_packages(self, base: str = "", listing: Callable[[str], Any] | None = None) -> list[str]:
        """Every package at or under `base` (directories with a BUILD file), skipping outputs and hidden dirs, in
        os.walk's order (sorted, top-down); each directory listed by `listing` (the build server's keeps them:
        LoadCache.listing)."""
        listing = listing or self.listing
        root = self._root_text.rstrip("/") or "/"
        found: list[str] = []
        stack = [base]
        while stack:
            rel = stack.pop()
            path = f"{root}/{rel}" if rel else root
            kept = listing(path)
            if kept is None:
                continue  # (os.walk skips what it cannot list)
            _m, subdirs, build, marker, _r = kept
            if rel and marker:  # a nested workspace is not part of this one
                continue
            if build is None:  # (a BUILD that is not a regular file: asked every time, as os.path.isfile)
                build = os.path.isfile(f"{path}/{BUILD_FILE}")
            if build:
                found.append(rel)
            stack.extend(reversed([f"{rel}/{d}" if rel else d for d in subdirs]))
        return found

    @staticmethod
    def listing(path: str) -> tuple[int, tuple[str, ...], bool | None, bool, bool] | None:
        """A directory's (mtime, subdirectories walked into, whether it has a regular BUILD file (None: a BUILD that
        is not a regular file), whether it has a workspace marker, `reusable`); None if it cannot be listed.
        `reusable`: the listing may be kept while the mtime is unchanged: not if that mtime is within the racy window
        (a second change in the same tick could hide) or its BUILD file is not a regular file (a link's target can
        change without the directory)."""
        now = time.time_ns()
        try:
            mtime = os.stat(path).st_mtime_ns
            with os.scandir(path) as it:
                entries = list(it)
        except OSError:
            return None
        subdirs = []
        build: bool | None = False
        marker = False
        for e in entries:
            n = e.name
            if n == MARKER:
                try:
                    marker = marker or not e.is_dir()  # (os.walk's filenames: what is not a directory)
                except OSError:
                    marker = True
            if n == BUILD_FILE:
                try:
                    build = True if e.is_file(follow_symlinks=False) else None if e.is_symlink() else False
                except OSError:
                    build = None
            try:
                if e.is_dir() and not e.is_symlink() and not n.startswith(".") and n != OUTPUT_DIR and \
                        not n.startswith("bazel-") and n != "__pycache__":
                    subdirs.append(n)
            except OSError:
                continue
        return mtime, tuple(sorted(subdirs)), build, marker, mtime < now - RACY_NS and build is not None

    def _bzl_source(self, text: str, current_package: str, loc: Location) -> tuple[str, Path, str]:
        try:
            label = parse_label(text, current_package)
        except LabelError as e:
            raise UserInputError(f"load(): {e}", loc) from None
        if not label.name.endswith(".bzl"):
            raise UserInputError(f"load(): '{text}' is not a .bzl file", loc)
        if label.repo == BUILTIN_REPO:
            path = self.rules_dir.joinpath(*label.package.split("/")[1:], label.name) if label.package.startswith(
                "rules") else self.rules_dir / "__missing__"
            display = f"@{BUILTIN_REPO}//{label.package}:{label.name}"
        else:
            path = self.root / label.package / label.name
            display = label.path
        if not path.is_file():
            raise UserInputError(f"load(): cannot load '{text}': file {display} not found", loc)
        self._inside(path, display, loc)
        return display, path, label.package

    # ---- evaluation --------------------------------------------------------------------------------------------------
    def load_package(self, package: str) -> Package:
        build_file = (f"{package}/{BUILD_FILE}" if package else BUILD_FILE)
        ctx = self._evaluate(package, build_file, None)
        return Package(package, build_file, tuple(ctx.targets.values()), tuple(sorted(ctx.files)))

    def locate(self, target: Target, attr: str | None = None) -> Location:
        """The call site (in its BUILD file) of the rule call that created `target`; with `attr`, where that
        attribute is written in the call (when the BUILD file's call writes it, not a macro's)."""
        try:
            self._evaluate(target.label.package, target.build_file, target.index)
        except _Located as e:
            if attr is None or e.location.path != target.build_file:
                return e.location
            try:
                src = _parse_source(target.build_file, self.root / target.build_file, target.label.package)
            except UserInputError:
                return e.location
            return attr_location(src.text, e.location, attr)
        except UserInputError:
            pass
        return Location(target.build_file)

    def _inside(self, path: Path, display: str, loc: Location) -> None:
        """BUILD and .bzl files (and symlinks to them) must resolve inside the workspace, or inside the shipped rules."""
        real = path.resolve()
        for base in (self.root, self.rules_dir):
            try:
                real.relative_to(base.resolve())
                return
            except ValueError:
                continue
        raise UserInputError(f"{display} points outside the workspace (to {real}); refusing to evaluate it", loc)

    def _evaluate(self, package: str, build_file: str, trap_index: int | None) -> _PackageContext:
        path = self.root / build_file
        self._inside(path, build_file, Location(build_file))
        src = _parse_source(build_file, path, package)
        ctx = _PackageContext(self, package, build_file, trap_index)
        interp = Interpreter(ctx.natives, build_file)
        executed: dict[str, _SourceFile] = {}
        imported = self._exec_loads(interp, ctx, src, executed, [])
        # Names that loaded .bzl files define but this BUILD file did not load are not visible to it.
        bzl_defined: dict[str, str] = {}
        for f in executed.values():
            for n in f.defined:
                bzl_defined.setdefault(n, f.display)
        for name, line, col in src.used:
            if name in bzl_defined and name not in imported and name not in src.stored:
                raise UserInputError(f"name '{name}' is not defined (it is in {bzl_defined[name]}: load() it)",
                                     Location(build_file, line, col))
        for name in src.defined:
            if name in bzl_defined and name not in imported:
                raise UserInputError(f"'{name}' shadows a name used by {bzl_defined[name]}; pick another name",
                                     Location(build_file))
        self._exec(interp, ctx, src, trap_index)
        return ctx

    def _exec(self, interp: Interpreter, ctx: _PackageContext, src: _SourceFile, trap_index: int | None) -> None:
        ctx.error = None
        try:
            interp.exec(src.text, src.display)
        except StarlarkFailure as e:
            self._raise_located(ctx, src, e, trap_index)

    def _raise_located(self, ctx: _PackageContext, src: _SourceFile, e: StarlarkFailure, trap: int | None) -> None:
        err = ctx.error
        ctx.error = None
        build_frames = [f for f in e.frames if f.path == ctx.build_file]
        if build_frames:
            f = build_frames[0]
            loc = Location(f.path, f.line, f.col)
        else:
            loc = Location(e.path, e.line, e.col)
        if isinstance(err, _Trap):
            raise _Located(loc)
        via = _via(e.frames, ctx.build_file)
        if isinstance(err, (AttrError, UserInputError)):
            msg = err.message if isinstance(err, UserInputError) else str(err)
            named = _ATTR_IN_MESSAGE.search(msg)
            if named and build_frames and (not isinstance(err, UserInputError) or err.location is None):
                loc = attr_location(src.text, loc, named.group(1))  # (at the attribute, not the call's "(")
            raise UserInputError(msg + via, loc)
        if err is not None:
            raise UserInputError(f"internal error in rule call: {err!r}", loc)
        if not e.frames:
            kind = "syntax error: " if "want" in e.message or "got" in e.message else ""
            raise UserInputError(kind + e.message + self._load_hint(e.message), Location(e.path, e.line, e.col))
        raise UserInputError(e.message + via + self._load_hint(e.message), loc)

    def _load_hint(self, message: str) -> str:
        """For `undefined: NAME` where a shipped .bzl file defines NAME: the load() line that provides it."""
        m = re.fullmatch(r"undefined: ([A-Za-z][A-Za-z0-9_]*)", message.strip())
        if m is None:
            return ""
        for bzl in sorted(self.rules_dir.glob("*.bzl")):
            try:
                text = bzl.read_text(encoding="utf-8")
            except OSError:
                continue
            if re.search(rf"^def {m.group(1)}\(", text, re.M):
                return f' (load("@{BUILTIN_REPO}//rules:{bzl.name}", "{m.group(1)}") provides it)'
        return ""

    def _exec_loads(self, interp: Interpreter, ctx: _PackageContext, src: _SourceFile,
                    executed: dict[str, _SourceFile], stack: list[str]) -> set[str]:
        """Execute src's loaded .bzl files (depth first, once each) and bind the loaded symbols. Returns local names."""
        imported: set[str] = set()
        for stmt in src.loads:
            loc = Location(src.display, stmt.line, stmt.col)
            display, path, pkg = self._bzl_source(stmt.label, src.package, loc)
            if display in stack or display == src.display:
                prefix = stack[stack.index(display):] if display in stack else []
                cycle = " -> ".join([*prefix, src.display, display])
                raise UserInputError(f"load cycle: {cycle}", loc)
            if display not in executed:
                bzl = _parse_bzl(display, path, pkg)
                self._exec_loads(interp, ctx, bzl, executed, [*stack, src.display])
                for other in executed.values():
                    clash = bzl.defined & other.defined
                    if clash:
                        name = sorted(clash)[0]
                        raise UserInputError(
                            f"'{name}' is defined by both {other.display} and {display}: loaded .bzl files share one "
                            "namespace per BUILD file, rename one", loc)
                self._exec(interp, ctx, bzl, None)
                executed[display] = bzl
                ctx.files.add(display)
            bzl_file = executed[display]
            binds = []
            for local, orig in stmt.symbols:
                if orig.startswith("_"):
                    raise UserInputError(f"load(): symbol '{orig}' is private to {display}", loc)
                if orig not in bzl_file.defined:
                    raise UserInputError(f"load(): {display} does not define '{orig}'", loc)
                if local != orig:
                    binds.append(f"{local} = {orig}")
                imported.add(local)
            if binds:
                alias_src = "\n" * (stmt.line - 1) + "; ".join(binds)
                self._exec(interp, ctx, _SourceFile(src.display, src.path, alias_src, (), src.package,
                                                    frozenset(), (), frozenset()), None)
        return imported


class _Located(Exception):
    def __init__(self, location: Location) -> None:
        super().__init__(str(location))
        self.location = location


def _via(frames: Iterable[Frame], build_file: str) -> str:
    inner = [f for f in frames if f.path != build_file]
    if not inner:
        return ""
    f = inner[-1]
    return f" (in {f.function} at {f.path}:{f.line}:{f.col})"
