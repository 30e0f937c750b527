"""The first hour, round 2 (#35), through the real CLI in subprocesses: a workspace made by `init` builds for cpu and
trn2 (real compiles, shared by this module), `weights convert`, model-source mistakes seen early and once, output you
can rely on (where outputs are, verbose no-ops, skipped Neuron compiles, explain/upgrade-impact order, cache stats),
and the CLI's papercuts (help/version commands, per-command flags, the default gc policy, `:name` hints)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_cli

NO_CC = {"NEURONX_CC": ""}
OUTPUTS = re.compile(r"^Outputs in (.+)neuronbuild-out: models/tiny_cpu/, models/tiny_trn2/, models/release_cpu.tar.zst$")


def _nb(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(args, cwd, {**NO_CC, **(env or {})})


def _summary_end(stdout: str) -> str:
    """The summary's last line (the invocation page's link, which follows it, left out)."""
    return [ln for ln in stdout.splitlines() if not ln.startswith("Invocation: ")][-1]


def _init(where: Path) -> Path:
    proc = run_cli(["init", str(where)], where.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return where


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """`neuronbuild init ws`, then `neuronbuild build` in it as it is: 2 traces, 2 cpu compiles, 2 lowerings and 2
    trn2 compiles (no neuronx-cc), with its own cache."""
    root = tmp_path_factory.mktemp("start")
    ws = _init(root / "ws")
    cache = root / "cache"
    proc = _nb(["build", "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws, cache, proc


# -- init -----------------------------------------------------------------------------------------------------------
def test_init_makes_a_workspace_that_builds_for_cpu_and_trn2(started) -> None:  # type: ignore[no-untyped-def]
    ws, _cache, proc = started
    assert {p.name for p in ws.iterdir()} >= {"WORKSPACE.neuronbuild", "models", "neuronbuild-out"}
    assert proc.stdout.startswith("9 actions: 9 executed, 0 cached")
    out = ws / "neuronbuild-out" / "models"
    for bucket in ("batch1", "batch4"):
        assert (out / "tiny_cpu" / bucket / "model.pt2").stat().st_size > 0
        assert (out / "tiny_trn2" / bucket / "model.hlo.pb").stat().st_size > 0
        assert (out / "tiny_trn2" / bucket / "compile_flags.json").is_file()
    manifest = json.loads((out / "tiny_cpu" / "manifest.json").read_text())
    assert [b["name"] for b in manifest["buckets"]] == ["batch1", "batch4"]


def test_init_prints_next_steps_and_never_overwrites(tmp_path: Path) -> None:
    proc = run_cli(["init", "proj"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Created a neuronbuild workspace in proj" in proc.stdout and "cd proj && neuronbuild build" in proc.stdout
    build = tmp_path / "proj" / "models" / "BUILD"
    build.write_text(build.read_text() + "# mine\n")
    again = run_cli(["init", "proj"], tmp_path)
    assert again.returncode == 2 and again.stdout == "" and again.stderr.count("\n") == 1
    assert "proj is already a workspace" in again.stderr
    assert build.read_text().endswith("# mine\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "models").mkdir()
    (tmp_path / "other" / "models" / "model.py").write_text("mine = 1\n")
    clash = run_cli(["init", "other"], tmp_path)
    assert clash.returncode == 2 and "already has models/model.py" in clash.stderr
    assert not (tmp_path / "other" / "WORKSPACE.neuronbuild").exists()  # nothing written when refused


def test_init_refuses_a_symlinked_directory_leading_out_of_the_workspace(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "models").symlink_to(outside)
    proc = run_cli(["init", "ws"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "leads outside ws" in proc.stderr and str(outside) in proc.stderr
    assert list(outside.iterdir()) == [] and not (tmp_path / "ws" / "WORKSPACE.neuronbuild").exists()
    (tmp_path / "ws" / "models").unlink()
    (tmp_path / "ws" / "models").symlink_to(tmp_path / "ws" / "pkg", target_is_directory=True)  # inside: fine
    (tmp_path / "ws" / "pkg").mkdir()
    assert run_cli(["init", "ws"], tmp_path).returncode == 0
    assert (tmp_path / "ws" / "pkg" / "BUILD").is_file()


# -- output you can rely on -----------------------------------------------------------------------------------------
def test_a_neuron_compile_without_neuronx_cc_says_skipped_and_is_not_estimated(started, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache, proc = started
    for bucket in ("batch=1", "batch=4"):
        line = next(ln for ln in proc.stderr.splitlines() if f"Compile //models:tiny_trn2 [{bucket}] for trn2" in ln)
        assert line.endswith(": skipped (no neuronx-cc)"), line
    assert re.search(r"Compile //models:tiny_cpu \[batch=1\] for cpu/\S+ \(\d+\.\d s\)", proc.stderr)
    fresh = _init(tmp_path / "ws")  # nothing recorded: the defaults, but a skipped compile is no time at all
    plan = _nb(["plan", "--output", "json", "--cache-dir", str(tmp_path / "cache")], fresh)
    assert plan.returncode == 0, plan.stderr
    est = {e["description"]: e for e in json.loads(plan.stdout)["execute"]}
    trn2 = [e for d, e in est.items() if d.startswith("Compile //models:tiny_trn2")]
    assert len(trn2) == 2 and all(e["estimate_s"] == 0 and e["estimate_source"] == "skipped (no neuronx-cc)"
                                  for e in trn2)
    assert all(e["estimate_s"] > 0 for d, e in est.items() if not d.startswith("Compile //models:tiny_trn2"))


def test_every_no_op_ends_with_where_outputs_are_and_verbose_no_ops_print_the_same(started) -> None:  # type: ignore[no-untyped-def]
    ws, cache, first = started
    assert OUTPUTS.match(_summary_end(first.stdout)), first.stdout
    runs = [_nb(["build", *flags, "--cache-dir", str(cache)], ws) for flags in ([], [], ["-v"], ["-v"], [])]
    for proc in runs:
        assert proc.returncode == 0 and proc.stdout.startswith("9 actions: 0 executed, 9 cached"), proc.stdout
        assert OUTPUTS.match(_summary_end(proc.stdout)), proc.stdout
    verbose = [sorted(ln for ln in p.stderr.splitlines() if ln.startswith("CACHED: ")) for p in runs[2:4]]
    assert len(verbose[0]) == 9 and verbose[0] == verbose[1]  # the weights action, 2 traces, 2 Lowers, 4 compiles
    assert "CACHED:" not in runs[1].stderr + runs[4].stderr


def _kinds(lines: list[str]) -> list[str]:
    return [re.sub(r" for \S+$", "", ln.split("  (")[0].split("  ")[0]) for ln in lines]


def test_explain_and_upgrade_impact_list_by_target_bucket_then_trace_lower_compile(started) -> None:  # type: ignore[no-untyped-def]
    ws, cache, _ = started
    build, model = ws / "models" / "BUILD", ws / "models" / "model.py"
    old_build, old_model = build.read_text(), model.read_text()
    try:
        build.write_text(old_build.replace('"batch": [1, 4]', '"batch": [1, 2, 4]'))  # a new bucket ...
        model.write_text(old_model + "# an edit\n")  # ... and an edit for the others
        proc = _nb(["explain", "--cache-dir", str(cache)], ws)
        assert proc.returncode == 0, proc.stderr
        heads = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith(" ") and "would execute" not in ln]
        expected = ["Weights //models:tiny"]  # the model's, shared by every bucket: its sources changed
        for b in (1, 2, 4):
            expected += [f"Trace //models:tiny [batch={b}]", f"Compile //models:tiny_cpu [batch={b}]"]
        for b in (1, 2, 4):
            expected += [f"Lower //models:tiny [batch={b}]", f"Compile //models:tiny_trn2 [batch={b}]"]
        assert _kinds(heads) == expected, heads
        blocks = proc.stdout.split("\n" + "C")  # (each block: an action and its reasons)
        new = next(b for b in blocks if "ompile //models:tiny_cpu [batch=2]" in b.split("\n")[0])
        assert "no previous result" in new and "skipped if" not in new  # no earlier result: no early cutoff
        changed = next(b for b in blocks if "ompile //models:tiny_cpu [batch=1]" in b.split("\n")[0])
        assert "(skipped if its inputs re-run to identical outputs: trace output unchanged)" in changed
    finally:
        build.write_text(old_build)
        model.write_text(old_model)
    up = _nb(["upgrade-impact", "--toolchain", "torch=99.0", "--cache-dir", str(cache)], ws)
    assert up.returncode == 0, up.stderr
    rows = [ln.strip() for ln in up.stdout.splitlines() if ln.startswith("  ")]
    assert _kinds([r.split("  ")[0] for r in rows]) == [  # each target's: its model's weights, then by bucket
        "Weights //models:tiny",
        "Trace //models:tiny [batch=1]", "Compile //models:tiny_cpu [batch=1]",
        "Trace //models:tiny [batch=4]", "Compile //models:tiny_cpu [batch=4]",
        "Weights //models:tiny",
        "Trace //models:tiny [batch=1]", "Lower //models:tiny [batch=1]", "Compile //models:tiny_trn2 [batch=1]",
        "Trace //models:tiny [batch=4]", "Lower //models:tiny [batch=4]", "Compile //models:tiny_trn2 [batch=4]"]


def test_cache_stats_counts_what_the_summary_counts(started, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache, _ = started
    model = ws / "models" / "model.py"
    old = model.read_text()
    try:
        model.write_text(old + "# a comment: the traces re-run, everything after them is reused by early cutoff\n")
        proc = _nb(["build", "--cache-dir", str(cache)], ws)
    finally:
        model.write_text(old)
    assert proc.returncode == 0, proc.stderr
    m = re.match(r"9 actions: (\d+) executed, (\d+) cached", proc.stdout)
    assert m is not None and m.groups() == ("3", "6"), proc.stdout  # the traces and the weights action re-run
    stats = _nb(["cache", "stats", "--cache-dir", str(cache)], ws)
    assert stats.returncode == 0, stats.stderr
    header = next(ln for ln in stats.stdout.splitlines() if ln.startswith("recent builds"))
    assert "executed  cached" in header
    rows = [ln for ln in stats.stdout.splitlines() if ln.startswith("  ") and "|" in ln]
    assert rows[-1].split()[2:4] == ["3", "6"], stats.stdout  # the last build, as its summary said
    assert rows[-1].split()[5:7] == ["6", "(6+0)"]  # the cache lookups beside it


# -- model sources checked at analysis; failures once, located ------------------------------------------------------
def test_a_syntax_error_in_a_model_source_is_one_located_error_before_anything_runs(tmp_path: Path) -> None:
    ws = _init(tmp_path / "ws")
    (ws / "vision").mkdir()
    model = (ws / "models" / "model.py").read_text()
    broken = model.replace("self.up = torch.nn.Linear(features, hidden)", "self.up = torch.nn.Linear(features,, hidden)")
    assert broken != model
    (ws / "vision" / "cnn.py").write_text(broken)
    (ws / "vision" / "BUILD").write_text((ws / "models" / "BUILD").read_text().replace('"model.py"', '"cnn.py"')
                                         .replace('"model:build"', '"cnn:build"'))
    line = broken.splitlines().index(next(ln for ln in broken.splitlines() if ",," in ln)) + 1
    col = broken.splitlines()[line - 1].index(",,") + 2
    for cmd in (["plan", "//vision:all"], ["build", "//vision:all"], ["build"]):
        proc = _nb([*cmd, "--cache-dir", str(tmp_path / "cache")], ws)
        assert proc.returncode == 2 and proc.stdout == "", (cmd, proc.stdout)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, (cmd, proc.stderr)
        assert proc.stderr.startswith(f"vision/cnn.py:{line}:{col}: error: syntax error in a model source"), \
            proc.stderr
    assert not (tmp_path / "cache" / "v1" / "logs").exists()  # nothing ran


@pytest.mark.parametrize("case", ["config_key", "input_spec"])
def test_a_failing_action_is_reported_once_with_its_buckets_and_located(tmp_path: Path, case: str) -> None:
    ws = _init(tmp_path / "ws")
    model, build = ws / "models" / "model.py", ws / "models" / "BUILD"
    if case == "config_key":
        model.write_text(model.read_text().replace('config["hidden"]', 'config["width"]'))
        line = next(i for i, ln in enumerate(model.read_text().splitlines(), 1) if '"width"' in ln)
        wanted = (f"config key 'width' is read by the factory model:build at models/model.py:{line} but not set in "
                  "the neuron_model's `config` in BUILD (it sets: features, hidden)")
    else:
        build.write_text(build.read_text().replace('"float32[batch, 16]"', '"float32[batch, 8]"'))
        line = next(i for i, ln in enumerate(model.read_text().splitlines(), 1) if "self.up(x)" in ln)
        wanted = "tracing failed: RuntimeError: "
    proc = _nb(["build", "//models:tiny_cpu", "--keep-going", "--jobs", "2", "--cache-dir", str(tmp_path / "c")],
               ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # A config key the factory reads fails the model's weights action too (it builds the module); a wrong input
    # spec only the traces (the weights action reads no inputs).
    weights_fail = case == "config_key"
    assert proc.stdout.startswith(f"5 actions: {0 if weights_fail else 1} executed, 0 cached"), proc.stdout
    assert f"{3 if weights_fail else 2} failed" in proc.stdout, proc.stdout
    end = proc.stderr[proc.stderr.index("  FAILED "):].splitlines()  # the account after the summary
    at = end.index("  FAILED Trace //models:tiny [batch=1], [batch=4] (2 buckets, the same error)")
    assert end[at + 1].strip().startswith(wanted), end[at + 1]
    assert end[at + 2].strip().startswith("log: ") and end[at + 2].endswith("(and 1 more log(s), one per bucket)")
    assert str(ws) not in proc.stderr  # workspace-relative paths only
    assert (any(ln.startswith("  FAILED Weights //models:tiny") for ln in end) if weights_fail else len(end) == 3), end
    live = [ln for ln in proc.stderr.splitlines() if ln.startswith("FAILED: ")]
    assert len(live) == 2 + weights_fail and sum("the same error as Trace //models:tiny" in ln for ln in live) == 1
    if case == "input_spec":  # torch's message, where in the sources, and the declared spec beside the traced shape
        assert f"(at models/model.py:{line})" in end[1]
        assert re.search(r"x: float32\[batch, 8\] traced as \[(1|4), 8\]", end[1]), end[1]


# -- weights convert ------------------------------------------------------------------------------------------------
def test_weights_convert_turns_a_state_dict_into_the_safetensors_a_model_loads(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    ws = _init(tmp_path / "ws")
    sys.path.insert(0, str(ws / "models"))
    try:
        import model as tiny  # type: ignore[import-not-found]

        trained = tiny.build({"features": 16, "hidden": 32})
        torch.save(trained.state_dict(), tmp_path / "tiny.pt")
        torch.save({"epoch": 3, "state_dict": trained.state_dict()}, tmp_path / "ckpt.pt")
        torch.save(trained, tmp_path / "whole.pt")  # (pickles a reference to model.TinyMLP)
    finally:
        sys.path.pop(0)
        sys.modules.pop("model", None)
    dest = ws / "models" / "tiny.safetensors"
    proc = run_cli(["weights", "convert", str(tmp_path / "tiny.pt"), str(dest)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 4 tensors" in proc.stdout and 'weights = "tiny.safetensors"' in proc.stdout
    got = load_file(dest)
    assert set(got) == set(trained.state_dict())
    mask = os.umask(0o022)
    os.umask(mask)
    assert dest.stat().st_mode & 0o777 == 0o666 & ~mask  # (the mode a plain open() gives: teammates can read it)
    assert all(torch.equal(got[k], v) for k, v in trained.state_dict().items())
    again = run_cli(["weights", "convert", str(tmp_path / "tiny.pt"), str(dest)], tmp_path)
    assert again.returncode == 2 and "exists (pass --force" in again.stderr
    nested = run_cli(["weights", "convert", str(tmp_path / "ckpt.pt"), str(tmp_path / "c.safetensors")], tmp_path)
    assert nested.returncode == 0 and "the state dict under 'state_dict'" in nested.stdout, nested.stderr
    refused = run_cli(["weights", "convert", str(tmp_path / "whole.pt"), str(tmp_path / "w.safetensors")], tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--allow-pickle" in refused.stderr
    assert not (tmp_path / "w.safetensors").exists()
    trusted = run_cli(["weights", "convert", str(tmp_path / "whole.pt"), str(tmp_path / "w.safetensors"),
                       "--allow-pickle"], ws / "models")  # (unpickling imports `model`: found from models/)
    assert trusted.returncode == 0, trusted.stderr
    assert set(load_file(tmp_path / "w.safetensors")) == set(trained.state_dict())
    # The converted file is what a neuron_model's `weights` loads, strictly (every key, every shape)
    from neuronbuild.toolchains.model_import import build_eager_model

    rec = {"package": "models", "entry": "model:build", "config": {"features": 16, "hidden": 32}, "seed": 1,
           "weights": "models/tiny.safetensors"}
    loaded = build_eager_model(rec, ws)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.state_dict().items())
    assert not loaded.training  # factories' modules are put in eval mode


# -- CLI ------------------------------------------------------------------------------------------------------------
def test_help_and_version_are_commands() -> None:
    from neuronbuild import __version__

    version = run_cli(["version"], REPO)
    assert version.returncode == 0 and version.stdout.splitlines()[0] == f"neuronbuild {__version__}"
    top = run_cli(["help"], REPO)
    assert top.returncode == 0 and re.search(r"^\s+init\s", top.stdout, re.M) and "-C DIR" in top.stdout
    gc = run_cli(["help", "cache", "gc"], REPO)
    assert gc.returncode == 0 and gc.stdout == run_cli(["cache", "gc", "-h"], REPO).stdout
    bad = run_cli(["help", "biuld"], REPO)
    assert bad.returncode == 2 and "did you mean 'build'" in bad.stderr


def test_a_cache_sub_command_lists_only_its_own_flags() -> None:
    proc = run_cli(["cache", "gc", "-h"], REPO)
    assert proc.returncode == 0
    for flag in ("--max-size", "--max-age", "--cache-dir", "--no-workspace"):
        assert flag in proc.stdout
    for flag in ("--neuronx-cc", "--action-env", "--toolchain", "--jobs"):
        assert flag not in proc.stdout, flag
    assert "--neuronx-cc" in run_cli(["build", "-h"], REPO).stdout


def test_cache_gc_without_limits_applies_the_default_policy_or_the_rc_files(tmp_path: Path) -> None:
    ws = _init(tmp_path / "ws")
    cache = tmp_path / "cache"
    (cache / "v1").mkdir(parents=True)
    proc = run_cli(["cache", "gc", "--no-workspace", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gc: no --max-size or --max-age given: using the default policy --max-size 20G "
                                  "--max-age 30d")
    (ws / ".neuronbuildrc").write_text("cache --max-age 7d\n")
    mine = run_cli(["cache", "gc", "--no-workspace", "--cache-dir", str(cache)], ws)
    assert mine.returncode == 0 and "default policy" not in mine.stdout, mine.stdout + mine.stderr
    assert run_cli(["cache", "stats", "--cache-dir", str(cache)], ws).returncode == 0  # other sub-commands skip it


def test_a_bare_target_name_inside_a_package_is_suggested_as_colon_name() -> None:
    models = REPO / "examples" / "models"
    proc = run_cli(["plan", "llama_cpu"], models)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.rstrip().endswith("did you mean :llama_cpu?"), proc.stderr
    near = run_cli(["plan", "lama_cpu"], models)
    assert near.returncode == 2 and "did you mean :llama_cpu" in near.stderr
    root = run_cli(["plan", "models/llama_cpu"], REPO / "examples")
    assert root.returncode == 2 and "did you mean //models:llama_cpu?" in root.stderr


def test_deploy_names_its_serving_directory_dest() -> None:
    proc = run_cli(["deploy", "-h"], REPO)
    assert proc.returncode == 0 and "--dest DIR, --cache-dir DIR" in proc.stdout
    missing = run_cli(["deploy", "nothing.tar.zst"], REPO)
    assert missing.returncode == 2 and "--dest" in missing.stderr


# -- progress bar ---------------------------------------------------------------------------------------------------
def test_the_live_display_shows_a_progress_bar_beside_the_eta() -> None:
    from rich.console import Console

    from neuronbuild.execution import events as ev
    from neuronbuild.execution.events import BuildEvent
    from neuronbuild.execution.progress import RichProgress, progress_bar

    assert progress_bar(0.0, 8) == "─" * 8 and progress_bar(0.5, 8) == "━" * 4 + "─" * 4 and progress_bar(1, 8) == "━" * 8
    p = RichProgress()
    plan = [{"fingerprint": f"f{i}", "estimate_s": s} for i, s in enumerate((1.0, 3.0))]
    p.tally.update(BuildEvent(ev.BUILD_STARTED, 0.0, {"to_execute": 2, "cached": 0, "jobs": 1, "plan": plan}))
    p.tally.update(BuildEvent(ev.ACTION_STARTED, 0.0, {"fingerprint": "f0", "description": "Trace a"}))
    p.tally.update(BuildEvent(ev.ACTION_FINISHED, 1.0, {"fingerprint": "f0", "description": "Trace a"}))
    console = Console(record=True, width=120)
    console.print(p)
    text = console.export_text()
    head = text.splitlines()[0]
    assert "[1/2]" in head and "━" * 6 + "─" * 18 + "  25%  ETA" in head, head  # 1 of 4 estimated seconds done


# -- make example: no setuptools warning ----------------------------------------------------------------------------
def test_make_setup_filters_setuptools_compat_mode_warning() -> None:
    """The Makefile's install line sets a PYTHONWARNINGS filter; it must be one Python accepts and that silences the
    setuptools warning (as pip re-emits it from the build backend) and nothing else."""
    line = next(ln for ln in (REPO / "Makefile").read_text().splitlines() if "editable_mode=compat" in ln
                and "pip install" in ln)
    m = re.search(r'PYTHONWARNINGS="([^"]+)"', line)
    assert m is not None, line
    code = ("import warnings\n"
            "warnings.warn('Compat editable installs\\n!!\\n\\n  ****\\n  The compat editable mode is transitional')\n"
            "warnings.warn('another warning')\n")
    env = {**os.environ, "PYTHONWARNINGS": m.group(1)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "Compat editable" not in proc.stderr and "another warning" in proc.stderr
    assert "Invalid -W option" not in proc.stderr

