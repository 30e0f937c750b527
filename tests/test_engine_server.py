"""Incremental truth (#27): whatever the build server has seen before, its answer equals a fresh `--batch` process's.

The issue's four-command reproduction (two compile targets sharing a bucket set), and a seeded differential random
walk over a small multi-package workspace: edits of BUILD files, a loaded .bzl's constants, model sources and data
files, targets and packages added, removed and renamed, interleaved with server plan/query/build of random target
subsets, server restarts and `cache gc`. After every step the server's plan equals a fresh `--batch` process's; after
a build, the output tree equals what a `--batch` build writes. A failure names the seed and step (re-run one walk with
NEURONBUILD_FUZZ_SEED=<seed>)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import Servers, _stop

MODEL = '''"""A tiny model: {act}."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.{act}(self.fc(x))


def build(config):
    return Tiny(int(config["width"]))
'''
FEAT = 8


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    s = Servers(tmp_path / "ob", tmp_path / "cache")
    yield s
    for info in s.root.glob("*/server.json"):
        _stop(info)


def _normal(p: subprocess.CompletedProcess[str], what: str) -> object:
    """A command's answer as compared: exit code and stdout (JSON parsed), the first error line."""
    if p.returncode == 0:
        try:
            return 0, json.loads(p.stdout)
        except ValueError:
            return 0, p.stdout
    errs = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert p.returncode in (1, 2), f"{what}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p.returncode, errs[:1]


def _plan(servers: Servers, ws: Path, cache: Path, patterns: list[str], *, batch: bool) -> object:
    args = (["--batch"] if batch else []) + ["plan", *patterns, "--cache-dir", str(cache), "--output", "json"]
    return _normal(servers.run(args, ws), f"{'batch' if batch else 'server'} plan {patterns}")


def _same_plan(servers: Servers, ws: Path, cache: Path, patterns: list[str], why: str) -> object:
    time.sleep(0.02)  # (an edit just made is inside the racy window of a stat: both sides must see it anyway)
    server = _plan(servers, ws, cache, patterns, batch=False)
    batch = _plan(servers, ws, cache, patterns, batch=True)
    if server != batch:
        raise AssertionError(f"{why}: the server's plan of {patterns} differs from --batch's\n" + _diff(server, batch))
    return server


def _diff(a: object, b: object) -> str:
    import difflib

    sa = json.dumps(a, indent=1, sort_keys=True).splitlines()
    sb = json.dumps(b, indent=1, sort_keys=True).splitlines()
    return "\n".join(list(difflib.unified_diff(sa, sb, "server", "batch", lineterm="", n=2))[:80])


def _tree(root: Path) -> dict[str, str]:
    """Every file under root by relative path -> sha256 (an output tree as compared)."""
    out = {}
    if root.exists():
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _modes(root: Path) -> dict[str, int]:
    """Every file and directory under root by relative path -> its permission bits."""
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in sorted(root.rglob("*"))}


def _execute_count(plan: object) -> int:
    assert isinstance(plan, tuple) and plan[0] == 0, plan
    return len(plan[1]["execute"])


# --- the reproduction ------------------------------------------------------------------------------------------

SHARED_BUILD = f'''neuron_model(name = "model", srcs = ["model.py"], entry = "model:build", config = {{"width": {FEAT}}},
             inputs = {{"x": "float32[batch, feat]"}})
neuron_buckets(name = "shapes", dims = {{"batch": BATCHES, "feat": [{FEAT}]}})
neuron_target(name = "trn2", platform = "trn2")
compiler_options(name = "o1", opt_level = 1)
compiler_options(name = "o2", opt_level = 2)
neuron_compile(name = "a", model = ":model", buckets = [":shapes"], target = ":trn2", options = ":o1")
neuron_compile(name = "c", model = ":model", buckets = [":shapes"], target = ":trn2", options = ":o2")
'''


def _shared_ws(base: Path, batches: list[int]) -> Path:
    ws = base / "ws"
    (ws / "m").mkdir(parents=True, exist_ok=True)
    (ws / "WORKSPACE.neuronbuild").write_text("")
    (ws / "m" / "model.py").write_text(MODEL.format(act="relu"))
    (ws / "m" / "BUILD").write_text(SHARED_BUILD.replace("BATCHES", repr(batches)))
    return ws


def test_plan_and_build_of_a_target_sharing_an_edited_bucket_set_agree_with_batch(servers: Servers,
                                                                                  tmp_path: Path) -> None:
    """The issue's four commands: two compile targets share a bucket set; after a batch size is added and one of them
    is built, the server's plan and build of the other include the new bucket (as --batch's do)."""
    ws = _shared_ws(tmp_path, [1])
    cache = servers.cache
    p = servers.run(["build", "//...", "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stderr.count("starting the build server") == 1  # said once, on stderr
    time.sleep(0.02)
    (ws / "m" / "BUILD").write_text(SHARED_BUILD.replace("BATCHES", "[1, 2]"))  # a batch size added
    p = servers.run(["build", "//m:a", "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    plan = _same_plan(servers, ws, cache, ["//m:c"], "after building //m:a")
    assert _execute_count(plan) == 1  # c's compile of the new bucket (its trace and lowering: built for a)
    p = servers.run(["build", "//m:c", "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "starting the build server" not in p.stderr
    out = ws / "neuronbuild-out"
    manifest = json.loads((out / "m" / "c" / "manifest.json").read_text())
    assert sorted(b["bucket"]["batch"] for b in manifest["buckets"]) == [1, 2]
    # what the server wrote has the modes a batch build gives it (the user's umask, not the server's private one)
    served = _modes(out)
    shutil.rmtree(out)
    p = servers.run(["--batch", "build", "//...", "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert p.returncode == 0 and "0 executed" in p.stdout, p.stdout + p.stderr[-3000:]
    umask = os.umask(0o022)
    os.umask(umask)
    assert served == _modes(out) and (umask & 0o044 or any(m & 0o044 for m in served.values())), served
    # and removed again: plans only (`plan //m:a` then `plan //m:c` is enough)
    time.sleep(0.02)
    (ws / "m" / "BUILD").write_text(SHARED_BUILD.replace("BATCHES", "[2]"))
    _same_plan(servers, ws, cache, ["//m:a"], "bucket 1 removed, plan //m:a")
    _same_plan(servers, ws, cache, ["//m:c"], "bucket 1 removed, plan //m:c")
    # after a restart the next server answers as a fresh process too
    assert servers.run(["shutdown"], ws).returncode == 0
    _same_plan(servers, ws, cache, ["//m:c"], "after a restart")


# --- the differential random walk --------------------------------------------------------------------------------------

ACTS = ("relu", "tanh", "sigmoid")


class Walk:
    """A random workspace state (written to disk after every edit) and the edits a walk makes to it."""

    def __init__(self, ws: Path, rng: random.Random) -> None:
        self.ws, self.rng = ws, rng
        self.batches = [1, 2]  # defs.bzl constant BATCHES (used by //common:shapes and some packages' own buckets)
        self.level = 2  # defs.bzl constant LEVEL (//common:base's opt_level)
        self.next_pkg = 0
        self.pkgs: dict[str, dict] = {}  # type: ignore[type-arg]
        for _ in range(3):
            self.add_package()
        self.write()

    def add_package(self) -> str:
        name = f"p{self.next_pkg}"
        self.next_pkg += 1
        rng = self.rng
        compiles = {}
        for k in range(rng.randint(1, 3)):
            compiles[f"c{k}"] = self.random_compile()
        self.pkgs[name] = {"seed": rng.randint(0, 3), "act": rng.choice(ACTS), "data": f"v{rng.randint(0, 2)}",
                           "local": [rng.randint(3, 5)], "local_uses_const": rng.random() < 0.5,
                           "compiles": compiles}
        return name

    def random_compile(self) -> dict:  # type: ignore[type-arg]
        rng = self.rng
        buckets = rng.choice([["//common:shapes"], [":local"], ["//common:shapes", ":local"]])
        return {"buckets": buckets, "target": rng.choice(["//common:trn1", "//common:trn2"]),
                "options": rng.choice(["//common:base", "//common:fast", ":own"])}

    def files(self) -> dict[str, str]:
        out = {
            "WORKSPACE.neuronbuild": "",
            "common/defs.bzl": (f"BATCHES = {self.batches!r}\nLEVEL = {self.level}\n\n"
                                'def tiny(name, seed, data):\n'
                                '    neuron_model(name = name, srcs = ["model.py"], entry = "model:build",\n'
                                f'                 config = {{"width": {FEAT}}}, inputs = {{"x": "float32[batch, feat]"}},\n'
                                '                 seed = seed, data = data)\n'),
            "common/BUILD": ('load(":defs.bzl", "BATCHES", "LEVEL")\n\n'
                             'neuron_target(name = "trn1", platform = "trn1")\n'
                             'neuron_target(name = "trn2", platform = "trn2")\n'
                             f'neuron_buckets(name = "shapes", dims = {{"batch": BATCHES, "feat": [{FEAT}]}})\n'
                             'compiler_options(name = "base", opt_level = LEVEL, model_type = "transformer")\n'
                             'compiler_options(name = "fast", deps = [":base"], opt_level = 1)\n'),
        }
        for name, p in self.pkgs.items():
            local = f"BATCHES + {p['local']!r}" if p["local_uses_const"] else repr(p["local"])
            lines = ['load("//common:defs.bzl", "BATCHES", "tiny")\n',
                     f'tiny(name = "m", seed = {p["seed"]}, data = ["data.txt"])',
                     f'neuron_buckets(name = "local", dims = {{"batch": {local}, "feat": [{FEAT}]}})',
                     'compiler_options(name = "own", deps = ["//common:base"], auto_cast = "matmult")']
            for cname, c in p["compiles"].items():
                lines.append(f'neuron_compile(name = "{cname}", model = ":m", buckets = {c["buckets"]!r}, '
                             f'target = "{c["target"]}", options = "{c["options"]}")'.replace("'", '"'))
            out[f"{name}/BUILD"] = "\n".join(lines) + "\n"
            out[f"{name}/model.py"] = MODEL.format(act=p["act"])
            out[f"{name}/data.txt"] = p["data"] + "\n"
        return out

    def write(self) -> None:
        want = self.files()
        for top in sorted(self.ws.iterdir()) if self.ws.exists() else ():
            if top.is_dir() and top.name.startswith("p") and top.name not in self.pkgs:
                shutil.rmtree(top)
        for rel, text in want.items():
            p = self.ws / rel
            if p.is_file() and p.read_text() == text:
                continue  # (unchanged files keep their stat)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)

    def labels(self) -> list[str]:
        return [f"//{n}:{c}" for n, p in self.pkgs.items() for c in p["compiles"]]

    def patterns(self) -> list[str]:
        rng = self.rng
        choices = ["//...", *self.labels(), *(f"//{n}:all" for n in self.pkgs)]
        return sorted(set(rng.sample(choices, k=min(len(choices), rng.randint(1, 3)))))

    def edit(self) -> str:
        """One random edit; returns what it did."""
        rng = self.rng
        name = rng.choice(sorted(self.pkgs))
        p = self.pkgs[name]
        kind = rng.choice(["batches", "batches", "level", "local", "seed", "act", "data", "options", "target",
                           "compile+", "compile-", "rename-target", "pkg+", "pkg-", "pkg-rename", "const-switch"])
        if kind == "batches":
            b = set(self.batches)
            b ^= {rng.randint(1, 4)}
            self.batches = sorted(b) or [1]
        elif kind == "level":
            self.level = 3 - self.level  # 1 <-> 2
        elif kind == "local":
            p["local"] = [rng.randint(3, 6)]
        elif kind == "seed":
            p["seed"] += 1
        elif kind == "act":
            p["act"] = rng.choice([a for a in ACTS if a != p["act"]])
        elif kind == "data":
            p["data"] = p["data"] + "x"
        elif kind in ("options", "target"):
            c = p["compiles"][rng.choice(sorted(p["compiles"]))]
            c |= {kind: self.random_compile()[kind]}
        elif kind == "compile+":
            p["compiles"][f"c{len(p['compiles']) + rng.randint(0, 9)}"] = self.random_compile()
        elif kind == "compile-" and len(p["compiles"]) > 1:
            del p["compiles"][rng.choice(sorted(p["compiles"]))]
        elif kind == "rename-target":
            old = rng.choice(sorted(p["compiles"]))
            p["compiles"][old + "r"] = p["compiles"].pop(old)
        elif kind == "pkg+" and len(self.pkgs) < 5:
            name = self.add_package()
        elif kind == "pkg-" and len(self.pkgs) > 3:
            del self.pkgs[name]
        elif kind == "pkg-rename":
            new = f"p{self.next_pkg}"
            self.next_pkg += 1
            self.pkgs[new] = self.pkgs.pop(name)
            self.write()  # (moved: the same files under another package)
            return f"{kind} {name} -> {new}"
        elif kind == "const-switch":
            p["local_uses_const"] = not p["local_uses_const"]
        self.write()
        return f"{kind} {name}"


def _walk(servers: Servers, tmp_path: Path, seed: int, steps: int, builds: int) -> None:
    rng = random.Random(seed)
    ws = tmp_path / "ws"
    ws.mkdir()
    walk = Walk(ws, rng)
    cache = servers.cache
    log: list[str] = []
    built = 0

    def fail(msg: str) -> None:
        pytest.fail(f"seed {seed} (NEURONBUILD_FUZZ_SEED={seed}), after steps:\n  " + "\n  ".join(log[-12:]) +
                    f"\n{msg}", pytrace=False)

    try:
        for step in range(steps):
            what = walk.edit() if rng.random() < 0.7 or step == 0 else "no edit"
            r = rng.random()
            if r < 0.06:
                what += "; server restart"
                assert servers.run(["shutdown"], ws).returncode == 0
            elif r < 0.10:
                what += "; cache gc"
                p = servers.run(["cache", "gc", "--max-size", "0", "--cache-dir", str(cache)], ws)
                assert p.returncode == 0, p.stderr[-2000:]
            elif r < 0.18:
                pats = walk.patterns()
                what += f"; query {pats}"
                q = [("deps(" + pats[0] + ")") if not pats[0].endswith("...") else pats[0]]
                s = _normal(servers.run(["query", *q], ws), "server query")
                b = _normal(servers.run(["--batch", "query", *q], ws), "batch query")
                log.append(f"{step}: {what}")
                if s != b:
                    fail(f"the server's query {q} differs from --batch's:\n{s}\n{b}")
            elif built < builds and r < 0.18 + 0.6 * builds / steps:
                built += 1
                target = rng.choice(walk.labels())
                what += f"; build {target}"
                log.append(f"{step}: {what}")
                p = servers.run(["build", target, "--jobs", "2", "--cache-dir", str(cache)], ws)
                if p.returncode != 0:
                    fail(f"server build {target} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
                out = ws / "neuronbuild-out"
                served = _tree(out)
                p = servers.run(["--batch", "build", target, "--jobs", "2", "--cache-dir", str(cache)], ws)
                if p.returncode != 0:
                    fail(f"batch build {target} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
                if "0 executed" not in p.stdout:
                    fail(f"--batch build {target} after the server's executed more:\n{p.stdout[-2000:]}")
                if _tree(out) != served:
                    fail(f"the server's build of {target} wrote another output tree than --batch's")
            if not log or not log[-1].startswith(f"{step}:"):
                log.append(f"{step}: {what}")
            pats = walk.patterns() if step % 4 else ["//..."]
            try:
                _same_plan(servers, ws, cache, pats, f"step {step}")
            except AssertionError as e:
                fail(str(e))
    except AssertionError as e:
        fail(str(e).split("\nassert ")[0])


# Seeds and steps: 4 x 80 = 320 plan checks (the issue asks >= 300 across the suite), builds of cheap targets rarely.
SEEDS = [int(os.environ["NEURONBUILD_FUZZ_SEED"])] if os.environ.get("NEURONBUILD_FUZZ_SEED") else [11, 22, 33, 44]


@pytest.mark.parametrize("seed", SEEDS)
def test_server_plans_equal_batch_plans_over_a_seeded_random_walk(servers: Servers, tmp_path: Path, seed: int) -> None:
    """The differential fuzz test: after every step of a seeded random walk the server's plan of a random subset of
    targets (every fourth step: //...) equals a fresh --batch process's; builds write the tree --batch writes."""
    _walk(servers, tmp_path, seed, steps=int(os.environ.get("NEURONBUILD_FUZZ_STEPS", "80")),
          builds=1 if seed % 2 else 0)


def test_compiler_scratch_removed_by_cache_gc_replaces_the_servers_warm_workers(tmp_path: Path) -> None:
    """`cache gc` (another process) removing compiler scratch the kept workers may remember (inductor's precompiled
    header) makes the server start new workers for its next build; untouched scratch keeps them."""
    from neuronbuild.cache.usage import SCRATCH, clear_scratch
    from neuronbuild.server.warm import WarmState

    scratch = tmp_path / SCRATCH
    (scratch / "inductor").mkdir(parents=True)
    header = scratch / "inductor" / "precompiled.h.gch"
    header.write_bytes(b"pch")
    old = time.time() - 3600
    os.utime(header, (old, old))  # made by an earlier build: older than the server's pool
    warm = WarmState()
    try:
        first = warm._pool_factory(1, {"TMPDIR": str(scratch)}, tmp_path)
        assert warm._pool_factory(1, {"TMPDIR": str(scratch)}, tmp_path) is first
        assert clear_scratch(tmp_path, time.time(), 24 * 3600) == 0  # gc with nothing old enough: kept
        assert warm._pool_factory(1, {"TMPDIR": str(scratch)}, tmp_path) is first
        clear_scratch(tmp_path, time.time(), 600)  # gc's grace period: the header goes
        assert not header.exists()
        second = warm._pool_factory(1, {"TMPDIR": str(scratch)}, tmp_path)
        assert second is not first
        assert warm._pool_factory(1, {"TMPDIR": str(scratch)}, tmp_path) is second
    finally:
        warm.close()
