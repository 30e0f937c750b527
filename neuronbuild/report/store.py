"""Where invocation records live (`<output base>/invocations/`), and keeping them bounded (last KEEP, MAX_BYTES).

The output base is the build server's, per workspace (server/protocol.server_paths), so batch and server builds of a
workspace share one history. One JSON file per invocation, written atomically; the rendered pages sit beside them."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from neuronbuild import jsondata
from neuronbuild.atomic import atomic_write_bytes

FORMAT = 1
KEEP = 50  # invocations kept per workspace
MAX_BYTES = 64 << 20  # and at most this much of them (records + pages)
DIR = "invocations"
SUMMARY_FIELDS = ("id", "command", "patterns", "started", "wall_s", "saved_s", "counts", "outcome", "noop", "same_as",
                  "total", "work_s")
KEEP_BASES = 20  # requests whose last full build a no-op may stand for
SKELETON = ".noop-page"  # suffix of a base's no-op page skeleton
PAGE_FACTOR = 3  # a record and its page(s) together, as a multiple of the record's size (for MAX_BYTES)


def output_base(workspace_root: Path, output_user_root: str | None = None) -> Path:
    """This workspace's output base: where its build server lives (`--output-user-root`, else
    $NEURONBUILD_OUTPUT_USER_ROOT, else ~/.cache/neuronbuild-server)."""
    from neuronbuild.server import protocol

    user_root = os.path.abspath(os.path.expanduser(output_user_root)) if output_user_root else \
        protocol.default_output_user_root()
    return Path(protocol.server_paths(str(workspace_root), user_root).output_base)


def new_id(started: float) -> str:
    """Sortable by time, unique enough across concurrent builds: 20261202-172544-123-4f2a."""
    t = time.gmtime(started)
    return f"{time.strftime('%Y%m%d-%H%M%S', t)}-{int(started * 1000) % 1000:03d}-{os.getpid() % 0x10000:04x}"


class InvocationStore:
    """The invocations of one workspace (one output base)."""

    def __init__(self, base: Path) -> None:
        self.dir = base / DIR

    def path(self, inv_id: str) -> Path:
        return self.dir / f"{inv_id}.json"

    def page(self, inv_id: str, compare: str | None = None) -> Path:
        return self.dir / (f"{inv_id}-vs-{compare}.html" if compare else f"{inv_id}.html")

    def skeleton(self, base_id: str) -> Path:
        """The page a no-op standing for `base_id` is made from (report/render.noop_skeleton)."""
        return self.dir / f"{base_id}{SKELETON}"

    def write(self, record: dict[str, Any]) -> Path:
        """Write a record, then drop what falls out of the bounds (from the index: no stat of every file)."""
        from neuronbuild.server.protocol import private_dir

        private_dir(self.dir.parent)
        self.dir.mkdir(exist_ok=True)
        data = json.dumps(record, separators=(",", ":"), default=str).encode()
        dest = self.path(record["id"])
        atomic_write_bytes(dest, data, self.dir, durable=False)  # a report, not cached data: no fsync
        entry = {k: record.get(k) for k in SUMMARY_FIELDS}
        entry["bytes"] = PAGE_FACTOR * len(data)
        index = [e for e in self.index() if e.get("id") != record["id"]] + [entry]
        index.sort(key=lambda e: str(e.get("id")))
        keep = self._keep(index)
        index = [e for e in index if e.get("id") in keep]
        with contextlib.suppress(OSError):  # advisory (trend plots): concurrent builds may lose an entry
            atomic_write_bytes(self.dir / "index.json", json.dumps(index).encode(), self.dir, durable=False)
        self._remove_all_but(keep)
        return dest

    def index(self) -> list[dict[str, Any]]:
        """The kept invocations' summaries (what trend plots need), oldest first."""
        data = _read_json(self.dir / "index.json")
        return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []

    def ids(self) -> list[str]:
        """Recorded invocations, oldest first."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        return sorted(n[:-5] for n in names if n.endswith(".json") and _owner(n))

    def load(self, inv_id: str) -> dict[str, Any] | None:
        data = _read_json(self.path(inv_id))
        return data if isinstance(data, dict) and data.get("format") == FORMAT else None

    def resolve(self, ref: str) -> str | None:
        """`last`, `last~N` (N before the last), a full id or a unique prefix of one."""
        ids = self.ids()
        if ref == "last" or ref.startswith("last~"):
            try:
                back = int(ref[5:]) if ref != "last" else 0
            except ValueError:
                return None
            return ids[-1 - back] if 0 <= back < len(ids) else None
        if ref in ids:
            return ref
        found = [i for i in ids if i.startswith(ref)]
        return found[0] if len(found) == 1 else None

    def previous(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The most recent earlier invocation of the same command and patterns (a no-op stands for its base)."""
        mine = str(record["id"])
        for e in reversed(self.index()):
            if str(e.get("id")) < mine and e.get("command") == record.get("command") and \
                    e.get("patterns") == record.get("patterns") and e.get("outcome") != "error":
                found = self.load(str(e["id"]))
                if found is not None:
                    return found
        return None

    def _bases_file(self) -> Path:
        return self.dir / "bases.json"

    def bases(self) -> dict[str, str]:
        """{request key digest: the last full build of that request}, for no-ops to stand for."""
        data = _read_json(self._bases_file())
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def set_base(self, key: str, inv_id: str) -> None:
        """The full build `inv_id` answered request `key`: a later no-op of that request stands for its actions
        (the KEEP_BASES most recent requests are remembered)."""
        bases = {k: v for k, v in self.bases().items() if k != _digest(key)}
        bases[_digest(key)] = inv_id
        kept = dict(list(bases.items())[-KEEP_BASES:])
        with contextlib.suppress(OSError):
            atomic_write_bytes(self._bases_file(), json.dumps(kept).encode(), self.dir, durable=False)

    def base(self, key: str) -> str | None:
        return self.bases().get(_digest(key))

    def _keep(self, index: list[dict[str, Any]]) -> set[str]:
        """The last KEEP invocations within MAX_BYTES (records and their pages, estimated), and the base of every
        recent request (the invocation a later no-op stands for)."""
        keep: set[str] = set()
        total = 0
        for e in reversed(index):
            size = int(e.get("bytes") or 0)
            if len(keep) >= KEEP or (keep and total + size > MAX_BYTES):
                break
            keep.add(str(e.get("id")))
            total += size
        return keep | set(self.bases().values())

    def _remove_all_but(self, keep: set[str]) -> None:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for n in names:
            owner = _owner(n)
            if owner and owner not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(self.dir / n)


def _read_json(path: Path) -> Any:
    """A store file's JSON value; None when it is absent or unreadable."""
    try:
        return jsondata.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _digest(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _owner(name: str) -> str:
    """The invocation a file in the store belongs to ("" for the index, pointers and temporary files)."""
    if name.endswith(SKELETON):
        return name[:-len(SKELETON)]
    if name.startswith(".") or name in ("index.json", "bases.json") or not name.endswith((".json", ".html")):
        return ""
    return name[:-5].split("-vs-")[0]
