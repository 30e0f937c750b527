"""The invocation page as a person sees it, in a real browser (Debian's headless Chromium driven by playwright; CI
installs it: .ci/run): pages of real builds of the tiny trn2 workspace (a partial rebuild after a bucket edit, a
failing neuronx-cc) and of the example workspace (the session's `built_example`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
from helpers import run_cli
from introspect_ws import (
    STANDIN,
    copy_ws,
    edit,
    tiny_built_fixture,  # noqa: F401  (registers the session fixture `tiny_built`)
)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
LINK = re.compile(r"^Invocation: (file://\S+)$", re.M)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail("no /usr/bin/chromium: install Debian's chromium (`apt-get install -y chromium`, as .ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:  # (launch() gives the browser a fresh temporary profile)
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class Opened:
    """A page opened in the browser, with every console error and uncaught exception it produced."""

    def __init__(self, browser: Any, url: str, js: bool = True) -> None:
        self.context = browser.new_context(java_script_enabled=js, viewport={"width": 1300, "height": 1000})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        path = Path(unquote(urlparse(url).path))
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:  # (rendered by a child after the command answered)
            time.sleep(0.1)
        self.page.goto(url, wait_until="load")

    def cells(self) -> list[dict[str, str]]:
        """The matrix cells as shown: state, target, bucket (and its name) and the text a person reads."""
        out = []
        for el in self.page.query_selector_all("td.cell"):
            out.append({k: el.get_attribute(f"data-{k}") or "" for k in ("state", "target", "bucket", "name")}
                       | {"text": el.inner_text()})
        return out

    def close(self) -> None:
        self.context.close()


def _url(proc: Any) -> str:
    m = LINK.search(proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith(m.group(0)), "the page's link is the summary's last line"
    return m.group(1)


def _png_is_blank(png: bytes) -> bool:
    """Whether a screenshot is one flat colour: its decompressed scanlines (filter byte + pixels) hold few values."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        kind = png[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += png[pos + 8:pos + 8 + n]
        pos += 12 + n
    return len(set(zlib.decompress(idat))) < 16


@pytest.fixture(scope="module")
def tiny_runs(tiny_built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three builds of a copy of the tiny workspace (its own cache copy and output base): as built (all cached), after
    a bucket edit (seq 16 -> 32: that bucket's trace, lowering and compile run), and with a neuronx-cc that fails."""
    ws0, cache0 = tiny_built
    base = tmp_path_factory.mktemp("report")
    ws, cache = copy_ws(ws0, base / "ws"), base / "cache"
    shutil.copytree(cache0, cache)
    env = {"NEURONX_CC": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(base / "output-root")}
    build = ["build", "--jobs", "2", "--cache-dir", str(cache)]
    first = run_cli(build, ws, env)
    assert first.returncode == 0 and "7 actions: 0 executed, 7 cached" in first.stdout, first.stdout + first.stderr
    edit(ws / "m/BUILD", '"seq": [8, 16]', '"seq": [8, 32]')
    partial = run_cli(build, ws, env)
    assert partial.returncode == 0 and "7 actions: 3 executed, 4 cached" in partial.stdout, partial.stderr
    noop = run_cli(build, ws, env)  # the fast path (nothing changed): a record standing for `partial`'s actions
    assert noop.returncode == 0 and "7 actions: 0 executed, 7 cached" in noop.stdout, noop.stderr
    edit(ws / "m/BUILD", 'model_type = "transformer"', 'model_type = "transformer", flags = ["--standin-mode=fail"]')
    failed = run_cli([*build, "--keep-going", "--neuronx-cc", str(STANDIN)], ws, env)
    assert failed.returncode == 1 and "2 failed" in failed.stdout, failed.stdout + failed.stderr
    return {"ws": ws, "env": env, "first": _url(first), "partial": _url(partial), "noop": _url(noop),
            "failed": _url(failed)}


def test_partial_rebuild_matrix_has_one_cell_per_bucket_and_target_with_its_state(browser: Any,
                                                                                  tiny_runs: dict[str, Any]) -> None:
    page = Opened(browser, tiny_runs["partial"])
    cells = page.cells()
    assert sorted((c["target"], c["bucket"], c["state"]) for c in cells) == [
        ("//m:tiny_trn2", "batch=1, seq=32", "executed"), ("//m:tiny_trn2", "batch=1, seq=8", "cached_local")]
    assert "cached (local)" in next(c["text"] for c in cells if c["state"] == "cached_local")
    summary = page.page.inner_text("#summary")
    assert re.search(r"3\s+executed", summary) and re.search(r"4\s+cached \(local\)", summary), summary  # + the weights action
    assert page.page.is_visible("#timeline svg rect.crit"), "the critical path is marked on the timeline"
    # No neuronx-cc here: the executed compile says it skipped its step, and the page that no NEFF was built.
    assert "compile skipped (no neuronx-cc)" in next(c["text"] for c in cells if c["state"] == "executed")
    assert re.search(r"1\s+executed action skipped its step \(no neuronx-cc\).*no NEFF was built", summary), summary
    # One wall time: the timeline spans the summary's, widened (to the left) only by a worker warm-up begun before
    # the cache check (the build's record: its t0 and the slices; ci1 saw 11.26 vs 11.20 s when t0 was the recorder's
    # creation, before the executor's start-up, instead of the cache check)
    wall = float(re.search(r"([\d.]+) s\s+wall", summary)[1])  # type: ignore[index]
    span = float(re.search(r"Timeline \(([\d.]+) s", page.page.inner_text("#timeline"))[1])  # type: ignore[index]
    rec = json.loads(Path(unquote(urlparse(tiny_runs["partial"]).path)).with_suffix(".json").read_text())
    early = max(0.0, float(rec["t0"]) - min(float(s["start"]) for s in rec["slices"]))
    assert wall - 0.051 <= span <= wall + early + 0.051, (span, wall, early)
    # a cell links to its action's details: the fingerprint record's fields are there
    href = page.page.get_attribute("td.cell[data-state=executed] a", "href")
    page.page.click("td.cell[data-state=executed] a")
    assert href and href.startswith("#") and page.page.url.endswith(href)
    page.page.click(f"{href} > summary")
    record = page.page.inner_text(f"{href} table.record")
    assert "bucket.seq" in record and "32" in record and "Compile //m:tiny_trn2 [batch=1, seq=32]" in \
        page.page.inner_text(f"{href} > summary")
    assert page.errors == []
    page.close()


def test_compare_view_lists_the_changed_bucket_field_against_the_previous_build(browser: Any,
                                                                               tiny_runs: dict[str, Any]) -> None:
    page = Opened(browser, tiny_runs["partial"])
    compare = page.page.inner_text("#compare")
    assert tiny_runs["first"].rsplit("/", 1)[1].removesuffix(".html") in compare  # against the build before it
    fields = page.page.eval_on_selector_all("li.changed-field", "els => els.map(e => e.dataset.field)")
    assert fields == ["bucket.seq"] * 3, fields  # the new bucket's trace, lowering and compile
    assert compare.count("bucket: seq 16 -> 32") == 3 and "compared with [batch=1, seq=16]" in compare
    assert page.errors == []
    page.close()


def test_failed_actions_come_first_and_their_cells_show_the_error(browser: Any, tiny_runs: dict[str, Any]) -> None:
    page = Opened(browser, tiny_runs["failed"])
    assert page.page.inner_text("#outcome") == "failed"
    sections = page.page.eval_on_selector_all("main > section", "els => els.map(e => e.id)")
    assert sections[0] == "failures", sections
    cells = page.cells()
    assert {c["state"] for c in cells} == {"failed"} and len(cells) == 2
    for c in cells:
        assert "neuronx-cc exited with status" in c["text"], c["text"]
    failure = page.page.inner_text("#failures")
    assert failure.count("Compile //m:tiny_trn2") == 2 and "log:" in failure
    excerpt = page.page.inner_text("details.action[open] pre")  # the failed action's log excerpt, open
    assert "neuronx-cc" in excerpt
    assert page.errors == []
    page.close()


def test_page_renders_without_javascript(browser: Any, tiny_runs: dict[str, Any]) -> None:
    page = Opened(browser, tiny_runs["partial"], js=False)
    cells = page.cells()
    assert sorted(c["state"] for c in cells) == ["cached_local", "executed"]
    assert "executed" in page.page.inner_text("#summary")
    assert page.page.is_visible("#matrix-table") and page.page.is_visible("#compare")
    page.close()


def test_filter_and_sort_run_without_console_errors(browser: Any, tiny_runs: dict[str, Any]) -> None:
    page = Opened(browser, tiny_runs["failed"])
    page.page.select_option("#state-filter", "executed")
    assert page.page.locator("tr.mrow:not(.hidden)").count() == 0  # every cell failed
    page.page.select_option("#state-filter", "failed")
    assert page.page.locator("tr.mrow:not(.hidden)").count() == 2
    page.page.click("#actions-table th[data-col='2']")
    page.page.click("#actions-table th[data-col='2']")
    assert page.errors == []
    page.close()


def test_report_command_renders_last_and_an_explicit_compare(tiny_runs: dict[str, Any], browser: Any) -> None:
    ws, env = tiny_runs["ws"], tiny_runs["env"]
    last = run_cli(["report"], ws, env)  # (the failing build's)
    assert last.returncode == 0 and last.stdout.strip() == tiny_runs["failed"], last.stdout + last.stderr
    first_id = tiny_runs["first"].rsplit("/", 1)[1].removesuffix(".html")
    vs = run_cli(["report", "last~2", "--compare", first_id], ws, env)  # the partial rebuild vs the first build
    assert vs.returncode == 0 and vs.stdout.strip().endswith(f"-vs-{first_id}.html"), vs.stdout + vs.stderr
    data = json.loads(run_cli(["report", "last~2", "--output", "json"], ws, env).stdout)
    assert len([c for r in data["matrix"]["rows"] for c in r["cells"].values()]) == 2
    assert [f["field"] for c in data["compare"]["changed"] for f in c["fields"]] == ["bucket.seq"] * 3
    bad = run_cli(["report", "nosuch"], ws, env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no recorded invocation 'nosuch'" in bad.stderr


def test_example_workspace_page_has_every_cell_opens_fast_and_is_not_blank(browser: Any, built_example: Any,
                                                                          cache_dir: Path) -> None:
    ws, proc = built_example
    url = _url(proc)
    plan = json.loads(run_cli(["plan", "--output", "json", "--cache-dir", str(cache_dir)], ws).stdout)
    want = sorted((t["label"], b["name"]) for t in plan["targets"] for b in t["buckets"])
    page = Opened(browser, url)
    # Fast to open: one self-contained file of bounded size (no other request); a generous bound on its load time
    # catches a hang, not a busy machine (~100 ms here).
    load_ms = page.page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
    assert 0 < load_ms < 30_000, f"the page took {load_ms:.0f} ms to load"
    assert page.page.evaluate("performance.getEntriesByType('resource').length") == 0
    assert Path(unquote(urlparse(url).path)).stat().st_size < 2 << 20
    cells = page.cells()
    assert sorted((c["target"], c["name"]) for c in cells) == want  # one cell per (model, graph, bucket, target)
    m = re.search(r"(\d+) actions: (\d+) executed, (\d+) cached", proc.stdout)
    assert m is not None
    assert page.page.inner_text("#n-total") == m.group(1) and page.page.inner_text("#n-executed") == m.group(2)
    assert {c["state"] for c in cells} <= {"executed", "cached_local", "cutoff"}
    shot = page.page.screenshot(full_page=True)
    assert not _png_is_blank(shot)
    assert page.errors == []
    page.close()
    blank = browser.new_page()
    blank.set_content("<html><body></body></html>")
    assert _png_is_blank(blank.screenshot())  # (the check can fail)
    blank.close()



def test_noop_page_shows_every_cell_cached(browser: Any, tiny_runs: dict[str, Any]) -> None:
    page = Opened(browser, tiny_runs["noop"])
    assert sorted((c["bucket"], c["state"]) for c in page.cells()) == [
        ("batch=1, seq=32", "cached_local"), ("batch=1, seq=8", "cached_local")]
    assert page.page.inner_text("#n-cached_local") == "7" and page.page.inner_text("#n-executed") == "0"
    assert "no-op" in page.page.inner_text("header")
    assert page.errors == []
    page.close()


def test_an_interrupted_build_is_recorded_as_interrupted(tiny_built: tuple[Path, Path], tmp_path: Path) -> None:
    ws0, cache0 = tiny_built
    ws, cache = copy_ws(ws0, tmp_path / "ws"), tmp_path / "cache"
    shutil.copytree(cache0, cache)
    edit(ws / "m/BUILD", '"seq": [8, 16]', '"seq": [8, 24]')
    env = {"NEURONX_CC": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(tmp_path / "output-root")}
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "neuronbuild", "build", "--jobs", "1", "--cache-dir", str(cache),
                             "--build-event-json-file", str(events)], cwd=ws, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (events.exists() and "action_started" in events.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 8, out + err
    assert LINK.search(err), err  # the link is printed (on stderr) when a build is interrupted too
    data = json.loads(run_cli(["report", "--output", "json"], ws, env).stdout)
    assert data["rec"]["outcome"] == "interrupted"
    states = {a["description"]: a["state"] for a in data["rec"]["actions"]}
    assert states["Trace //m:tiny [batch=1, seq=24]"] == "stopped", states
    assert states["Compile //m:tiny_trn2 [batch=1, seq=24] for trn2"] == "not_started", states


def test_the_store_keeps_the_last_invocations_and_the_base_a_noop_stands_for(tmp_path: Path) -> None:
    from neuronbuild.report.store import KEEP, InvocationStore

    store = InvocationStore(tmp_path / "base")
    ids = [f"20260101-000000-{i:03d}-0001" for i in range(KEEP + 5)]
    for i, inv_id in enumerate(ids):
        store.write({"format": 1, "id": inv_id, "command": "build", "patterns": ["//..."], "actions": []})
        if i == 0:
            store.set_base("request", inv_id)  # a later no-op of that request stands for the first build
        (store.dir / f"{inv_id}.html").write_text("<html></html>")
    kept = store.ids()
    assert kept == [ids[0], *ids[-KEEP:]]
    assert [e["id"] for e in store.index()] == kept
    assert not (store.dir / f"{ids[1]}.html").exists() and (store.dir / f"{ids[0]}.html").exists()
    assert store.resolve("last") == ids[-1] and store.resolve("last~1") == ids[-2] and store.base("request") == ids[0]


def test_results_from_the_shared_tier_show_as_cached_shared(browser: Any, tiny_built: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    ws0, cache0 = tiny_built
    ws, shared = copy_ws(ws0, tmp_path / "ws"), tmp_path / "shared"
    shutil.copytree(cache0, shared)  # a shared directory tier holding every result; the local cache is empty
    env = {"NEURONX_CC": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(tmp_path / "output-root")}
    # (a copy of a local cache: its records are unsigned, served only when the tier's writers are trusted, #49)
    proc = run_cli(["build", "--cache-dir", str(tmp_path / "local"), "--remote-cache", str(shared),
                    "--remote-cache-trust-writers"], ws, env)
    assert proc.returncode == 0 and "0 executed, 7 cached" in proc.stdout, proc.stdout + proc.stderr
    page = Opened(browser, _url(proc))
    assert {c["state"] for c in page.cells()} == {"cached_shared"} and len(page.cells()) == 2
    assert page.page.inner_text("#n-cached_shared") == "7" and page.page.inner_text("#n-cached_local") == "0"
    assert page.errors == []
    page.close()


def _served_copy(tiny_built: tuple[Path, Path], tmp_path: Path) -> tuple[Path, dict[str, str], list[str]]:
    """A copy of the built tiny workspace and its cache whose commands go through a build server under tmp_path:
    (workspace, environment, the build command)."""
    ws0, cache0 = tiny_built
    ws, cache = copy_ws(ws0, tmp_path / "ws"), tmp_path / "cache"
    shutil.copytree(cache0, cache)
    env = {"NEURONX_CC": "", "NEURONBUILD_NO_SERVER": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(tmp_path / "root")}
    return ws, env, ["build", "--jobs", "2", "--cache-dir", str(cache)]


def test_a_build_server_records_into_the_same_output_base_as_batch_builds(browser: Any, tiny_built: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    ws, env, build = _served_copy(tiny_built, tmp_path)
    try:
        served = run_cli(build, ws, env)
        assert served.returncode == 0 and "0 executed, 7 cached" in served.stdout, served.stdout + served.stderr
        info = json.loads(run_cli(["info", "--output", "json"], ws, env).stdout)
        assert info["running"], info
        batch = run_cli(["--batch", *build], ws, env)
    finally:
        run_cli(["shutdown"], ws, env)
    page = Path(unquote(urlparse(_url(served)).path))
    assert page.parent == Path(info["output_base"]) / "invocations", (page, info)
    listed = run_cli(["report", "--list"], ws, env).stdout.splitlines()
    assert len(listed) == 2 and all("build //...  ok  7 actions, 0 executed" in ln for ln in listed), listed
    opened = Opened(browser, _url(served))
    assert sorted(c["state"] for c in opened.cells()) == ["cached_local", "cached_local"]
    assert opened.errors == []
    opened.close()
    assert batch.returncode == 0 and _url(batch).rsplit("/", 1)[1].removesuffix(".html") == listed[1].split()[0]


def _page_html(url: str) -> str:
    path = Path(unquote(urlparse(url).path))
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:  # (rendered by a child after the command answered)
        time.sleep(0.1)
    return path.read_text(encoding="utf-8")


def test_noop_pages_are_made_from_their_base_skeleton_each_with_its_own_id(tiny_built: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    from neuronbuild.report.store import SKELETON

    ws0, cache0 = tiny_built
    ws, cache = copy_ws(ws0, tmp_path / "ws"), tmp_path / "cache"
    shutil.copytree(cache0, cache)
    env = {"NEURONX_CC": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(tmp_path / "output-root")}
    build = ["build", "--jobs", "2", "--cache-dir", str(cache)]
    full = run_cli(build, ws, env)  # the full path (no stamp for this copy yet): the base of the no-ops below
    assert full.returncode == 0 and "7 actions: 0 executed, 7 cached" in full.stdout, full.stdout + full.stderr
    base_id = _url(full).rsplit("/", 1)[1].removesuffix(".html")
    skeleton = Path(unquote(urlparse(_url(full)).path)).with_name(base_id + SKELETON)

    def noop() -> tuple[str, str]:
        proc = run_cli(build, ws, env)
        assert proc.returncode == 0 and "7 actions: 0 executed, 7 cached" in proc.stdout, proc.stdout + proc.stderr
        url = _url(proc)
        return url.rsplit("/", 1)[1].removesuffix(".html"), _page_html(url)

    def shows(inv_id: str, html: str) -> None:
        assert f"<title>neuronbuild build {inv_id}: ok</title>" in html
        assert f"invocation {inv_id} &middot;" in html and f"no-op (nothing changed since {base_id})" in html
        assert re.findall(r'<td class="cell[^"]*" data-state="(\w+)"', html) == ["cached_local"] * 2
        assert '<b id="n-cached_local">7</b>' in html and '<b id="n-total">7</b>' in html
        assert f'r="4" fill="#d1242f"><title>{inv_id}:' in html  # its own dot marked on the trend plots
        assert html.count('<details class="action"') == 7

    first_id, first = noop()
    shows(first_id, first)
    made = skeleton.stat()
    second_id, second = noop()
    shows(second_id, second)
    assert f"invocation {first_id}" not in second and f"build {first_id}: ok" not in second
    assert (skeleton.stat().st_ino, skeleton.stat().st_mtime_ns) == (made.st_ino, made.st_mtime_ns)  # reused
    skeleton.write_text("0123456789abcdef01234567\n<html>made by other code</html>")
    third_id, third = noop()
    shows(third_id, third)  # a skeleton made by other code is made again, not used
    assert "made by other code" not in third and "made by other code" not in skeleton.read_text()


def test_the_server_writes_a_builds_record_and_no_op_stamp_before_its_next_command(tiny_built: tuple[Path, Path],
                                                                                   tmp_path: Path) -> None:
    ws, env, build = _served_copy(tiny_built, tmp_path)
    try:
        full = run_cli(build, ws, env)  # the full path (no stamp for this copy): record and stamp after the answer
        noop = run_cli(build, ws, env)  # right after it: answered from that stamp
        listed = run_cli(["report", "--list"], ws, env).stdout.splitlines()
    finally:
        run_cli(["shutdown"], ws, env)
    assert full.returncode == 0 and noop.returncode == 0 and "0 executed, 7 cached" in noop.stdout, noop.stdout
    assert len(listed) == 2 and "(no-op)" not in listed[0] and listed[1].endswith("(no-op)"), listed
    assert listed[0].split()[0] == _url(full).rsplit("/", 1)[1].removesuffix(".html")
    assert "invocation " + listed[1].split()[0] in _page_html(_url(noop))
