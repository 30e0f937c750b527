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

from neuronbuild.atomic import atomic_write_bytes

FORMAT = 1
KEEP = 50  # invocations kept per workspace
MAX_BYTES = 64 << 20  # and at most this much of them (records + pages)
DIR = "invocations"
SUMMARY_FIELDS = ("id", "command", "patterns", "started", "wall_s", "saved_s", "counts", "outcome", "noop", "same_as",
                  "total", "work_s")
KEEP_BASES = 20  # requests whose last full build a no-op may stand for


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

    def write(self, record: dict[str, Any]) -> Path:
        from neuronbuild.server.protocol import private_dir

        private_dir(self.dir.parent)
        self.dir.mkdir(exist_ok=True)
        data = json.dumps(record, separators=(",", ":"), default=str).encode()
        dest = self.path(record["id"])
        atomic_write_bytes(dest, data, self.dir, durable=False)  # a report, not cached data: no fsync
        kept = self.prune()
        index = [e for e in self.index() if e.get("id") in kept and e.get("id") != record["id"]]
        index.append({k: record.get(k) for k in SUMMARY_FIELDS})
        index.sort(key=lambda e: str(e.get("id")))
        with contextlib.suppress(OSError):  # advisory (trend plots): concurrent builds may lose an entry
            atomic_write_bytes(self.dir / "index.json", json.dumps(index).encode(), self.dir, durable=False)
        return dest

    def index(self) -> list[dict[str, Any]]:
        """The kept invocations' summaries (what trend plots need), oldest first."""
        try:
            data = json.loads((self.dir / "index.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []

    def ids(self) -> list[str]:
        """Recorded invocations, oldest first."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        return sorted(n[:-5] for n in names if n.endswith(".json") and _owner(n))

    def load(self, inv_id: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path(inv_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
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

    def _pointer(self, key: str) -> Path:
        import hashlib

        return self.dir / f"noop-{hashlib.sha256(key.encode()).hexdigest()[:20]}"

    def set_base(self, key: str, inv_id: str) -> None:
        """The full build `inv_id` answered request `key`: a later no-op of that request stands for its actions."""
        with contextlib.suppress(OSError):
            atomic_write_bytes(self._pointer(key), inv_id.encode(), self.dir, durable=False)
        pointers = sorted(self.dir.glob("noop-*"), key=lambda p: p.stat().st_mtime)
        for p in pointers[:-KEEP_BASES]:
            with contextlib.suppress(OSError):
                p.unlink()

    def base(self, key: str) -> str | None:
        try:
            return self._pointer(key).read_text(encoding="utf-8").strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def _bases(self) -> set[str]:
        out = set()
        for p in self.dir.glob("noop-*"):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                out.add(p.read_text(encoding="utf-8").strip())
        return out

    def prune(self) -> set[str]:
        """Keep the last KEEP invocations within MAX_BYTES (their pages count too), and the base of every recent
        request (the invocation a later no-op stands for); the ids kept."""
        ids = self.ids()
        names = [n for n in os.listdir(self.dir) if _owner(n)]
        sizes: dict[str, int] = {}
        for n in names:
            with contextlib.suppress(OSError):
                sizes[_owner(n)] = sizes.get(_owner(n), 0) + os.stat(self.dir / n).st_size
        keep: set[str] = set()
        total = 0
        for inv_id in reversed(ids):
            if len(keep) >= KEEP or (keep and total + sizes.get(inv_id, 0) > MAX_BYTES):
                break
            keep.add(inv_id)
            total += sizes.get(inv_id, 0)
        keep |= self._bases()
        for n in names:
            if _owner(n) not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(self.dir / n)
        return keep


def _owner(name: str) -> str:
    """The invocation a file in the store belongs to ("" for the index, pointers and temporary files)."""
    if name.startswith(".") or name == "index.json" or not name.endswith((".json", ".html")):
        return ""
    return name[:-5].split("-vs-")[0]
