"""`--action-env` values are secrets as often as not (tokens, keys): actions get them, and their digest enters
fingerprints, but no file the build writes holds them in plain text: action records, bundle manifests, build events,
invocation reports, no-op stamps (issue #31)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from helpers import run_cli
from introspect_ws import tiny_ws

TOKEN = "tok-5ecret-9f2c41d7"  # from the caller's environment (--action-env MY_TOKEN)
OTHER = "pw-0ther-8e1b77aa"  # on the command line (--action-env OTHER=VALUE)


def _files_holding(root: Path, needle: str) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and needle.encode() in p.read_bytes()]


def test_action_env_values_are_in_no_record_manifest_event_or_report_but_change_fingerprints(tmp_path: Path) -> None:
    ws, cache, our = tiny_ws(tmp_path / "ws", seqs=(8,)), tmp_path / "cache", tmp_path / "our"
    env = {"NEURONX_CC": "", "MY_TOKEN": TOKEN, "NEURONBUILD_OUTPUT_USER_ROOT": str(our)}
    flags = ["--cache-dir", str(cache), "--action-env", "MY_TOKEN", "--action-env", f"OTHER={OTHER}"]
    proc = run_cli(["build", *flags, "--build-event-json-file", str(tmp_path / "events.jsonl")], ws, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 executed" in proc.stdout, proc.stdout  # weights, trace, lower, compile
    again = run_cli(["build", *flags], ws, env)  # a no-op: writes its stamp
    assert again.returncode == 0 and "0 executed" in again.stdout, again.stdout + again.stderr
    # The invocations' pages are rendered by a child after each command answers: scan them once they are all there.
    records = lambda: {p.stem for p in our.rglob("invocations/*.json") if p.stem not in ("index", "bases")}  # noqa: E731
    deadline = time.monotonic() + 60
    while {p.stem for p in our.rglob("invocations/*.html")} < records() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(records()) == 2 and {p.stem for p in our.rglob("invocations/*.html")} >= records()
    for secret in (TOKEN, OTHER):
        assert _files_holding(tmp_path, secret) == []
    assert (ws / "neuronbuild-out" / "m" / "tiny_trn2" / "manifest.json").is_file()  # (scanned above)
    # The records keep the names (what was declared).
    records = [json.loads(p.read_text()) for p in (cache / "v1" / "ac").glob("*/*.json")]
    assert len(records) == 4 and all(set(r["record"]["env"]) == {"MY_TOKEN", "OTHER"} for r in records)
    # The value still decides the fingerprints: another value is another build, the same value a cache hit.
    plan = run_cli(["plan", "--output", "json", *flags], ws, {**env, "MY_TOKEN": "another"})
    assert plan.returncode == 0 and len(json.loads(plan.stdout)["execute"]) == 4, plan.stderr
    plan = run_cli(["plan", "--output", "json", *flags], ws, env)
    assert plan.returncode == 0 and json.loads(plan.stdout)["execute"] == [], plan.stderr
