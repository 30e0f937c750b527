"""Options reach only the graphs they change: a toolchain fingerprints only the compiler options it declares, so an
opt_level edit (a neuronx-cc option) re-runs the trn2 compile and no cpu action, and says that cpu ignores it."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import MODEL_SRC, run_cli, write_ws

BUILD = """
neuron_model(name = "tiny", srcs = ["llama.py"], entry = "llama:build_model",
             config = {{"vocab": 64, "hidden": 16, "layers": 1, "heads": 2}},
             inputs = {{"input_ids": "int64[batch, seq]"}})
neuron_buckets(name = "b", dims = {{"batch": [1], "seq": [8]}})
neuron_target(name = "cpu", platform = "cpu")
neuron_target(name = "trn2", platform = "trn2")
compiler_options(name = "opts", opt_level = {level})
neuron_compile(name = "tiny_cpu", model = ":tiny", buckets = [":b"], target = ":cpu", options = ":opts")
neuron_compile(name = "tiny_trn2", model = ":tiny", buckets = [":b"], target = ":trn2", options = ":opts")
"""


def test_an_opt_level_edit_reruns_the_trn2_compile_and_no_cpu_action(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC, "m/BUILD": BUILD.format(level=2)})
    cache = ["--cache-dir", str(tmp_path / "cache"), "--jobs", "1"]
    first = run_cli(["build", *cache], ws)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "5 actions: 5 executed" in first.stdout, first.stdout
    # The cpu compile is told, at its call site, that its toolchain does not read opt_level.
    warning = [line for line in first.stderr.splitlines() if "ignores option" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: m/BUILD:9:"), first.stderr
    assert "//m:tiny_cpu" in warning[0] and "opt_level" in warning[0], warning
    cpu_manifest = json.loads((ws / "neuronbuild-out/m/tiny_cpu/manifest.json").read_text())
    assert cpu_manifest["options"] == {"auto_cast": "none"}, cpu_manifest["options"]

    (ws / "m/BUILD").write_text(BUILD.format(level=3))
    explained = run_cli(["explain", "--output", "json", *cache[:2]], ws)
    assert explained.returncode == 0, explained.stderr
    report = json.loads(explained.stdout)
    todo = [(e["platform"], e["kind"], [c["field"] for c in e["changes"]]) for e in report["execute"]]
    assert todo == [("trn2", "compile", ["options.opt_level"])], todo
    assert report["ignored_options"] == [{"label": "//m:tiny_cpu", "toolchain": "aoti", "options": ["opt_level"]}]
    text = run_cli(["explain", *cache[:2]], ws)
    assert "toolchain 'aoti' (cpu/" in text.stdout and "ignores option opt_level" in text.stdout, text.stdout

    again = run_cli(["build", *cache], ws)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "5 actions: 1 executed, 4 cached" in again.stdout, again.stdout
    flags = json.loads(next((ws / "neuronbuild-out/m/tiny_trn2").glob("*/compile_flags.json")).read_text())
    assert "-O3" in json.dumps(flags), flags


def test_an_option_no_toolchain_reads_is_refused_at_its_call_site(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC,
                                    "m/BUILD": BUILD.format(level=2) + 'compiler_options(name = "x", isa = "v3")\n'})
    proc = run_cli(["plan", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("m/BUILD:11:") and "unknown attribute 'isa'" in proc.stderr, proc.stderr


FLAGS_BUILD = """
neuron_model(name = "tiny", srcs = ["llama.py"], entry = "llama:build_model",
             config = {{"vocab": 64, "hidden": 16, "layers": 1, "heads": 2}},
             inputs = {{"input_ids": "int64[batch, seq]"}})
neuron_buckets(name = "b", dims = {{"batch": [1], "seq": [8]}})
neuron_target(name = "trn2", platform = "trn2")
compiler_options(name = "opts", opt_level = 2, flags = {flags})
neuron_compile(name = "tiny_trn2", model = ":tiny", buckets = [":b"], target = ":trn2", options = ":opts")
"""


def test_raw_flags_are_checked_against_the_neuronx_cc_contract_without_neuronx_cc(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    plan = ["plan", "--cache-dir", str(tmp_path / "cache")]
    env = {"NEURONX_CC": ""}
    # Documented flags and NxD Inference's internal ones pass quietly.
    write_ws(ws, {"m/llama.py": MODEL_SRC, "m/BUILD": FLAGS_BUILD.format(
        flags='["--enable-saturate-infinity", "--internal-hlo2tensorizer-options=--x"]')})
    quiet = run_cli(plan, ws, env)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr
    # An unknown flag is a located warning; the plan goes on.
    (ws / "m/BUILD").write_text(FLAGS_BUILD.format(flags='["--no-such-flag"]'))
    warned = run_cli(plan, ws, env)
    assert warned.returncode == 0, warned.stderr
    assert warned.stderr.startswith("warning: m/BUILD:8:") and warned.stderr.count("\n") == 1, warned.stderr
    assert "'--no-such-flag' is not a documented neuronx-cc flag" in warned.stderr
    # A flag setting what an option sets (here beside opt_level's -O2) is a located error, before anything runs.
    for flag, option in (("--optlevel=9", "opt_level"), ("-O3", "opt_level"), ("--auto-cast=all", "auto_cast")):
        (ws / "m/BUILD").write_text(FLAGS_BUILD.format(flags=f'["{flag}", "--no-such-flag"]'))
        refused = run_cli(plan, ws, env)
        assert refused.returncode == 2 and refused.stdout == "", (flag, refused.stdout)
        assert refused.stderr.startswith("m/BUILD:8:") and refused.stderr.count("\n") == 1, refused.stderr
        assert f"'{flag}' sets what the option {option} sets" in refused.stderr, refused.stderr
