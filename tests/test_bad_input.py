"""Bad BUILD input: each case gives one `path:line:col: error: ...` line and exit code 2, never a traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

from neuronbuild.cli import main

MODEL = 'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "int64[batch, seq]"})\n'
SRC = {"pkg/m.py": "def build(config):\n    raise NotImplementedError\n"}

CASES = [
    # (id, files, expected location prefix: the attribute when the error is about one, expected message fragment)
    ("unknown_attr", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2", colour = "red")\n'},
     "pkg/BUILD:1:46", "unknown attribute 'colour'"),
    ("missing_attr", {"pkg/BUILD": '\n\nneuron_target(name = "t")\n'}, "pkg/BUILD:3:14",
     "missing required attribute 'platform'"),
    ("mistyped_attr", {"pkg/BUILD": 'neuron_buckets(name = "b", dims = {"batch": "4"})\n'}, "pkg/BUILD:1:28",
     "dimension 'batch' needs a non-empty list"),
    ("mistyped_int", {"pkg/BUILD": 'compiler_options(name = "o", opt_level = "2")\n'}, "pkg/BUILD:1:30",
     "'opt_level' must be an int"),
    ("bad_choice", {"pkg/BUILD": 'neuron_target(name = "t", platform = "tpu")\n'}, "pkg/BUILD:1:27",
     "'platform' must be one of"),
    ("duplicate", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2")\nneuron_target(name = "t", platform = "trn1")\n'},
     "pkg/BUILD:2:14", "duplicate target name 't'"),
    ("dangling", {"pkg/BUILD": MODEL + 'neuron_target(name = "t", platform = "trn2")\n'
                  'neuron_compile(name = "c", model = ":m", buckets = [":nope"], target = ":t")\n', **SRC},
     "pkg/BUILD:3:42", "refers to '//pkg:nope', which does not exist"),
    ("dangling_package", {"pkg/BUILD": MODEL + 'neuron_target(name = "t", platform = "trn2")\n'
                          'neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8]})\n'
                          'neuron_compile(name = "c", model = ":m", buckets = [":b"], target = "//other:t")\n', **SRC},
     "pkg/BUILD:4:60", "no BUILD file"),
    ("wrong_kind", {"pkg/BUILD": MODEL + 'neuron_target(name = "t", platform = "trn2")\n'
                    'neuron_compile(name = "c", model = ":t", buckets = [], target = ":t")\n', **SRC},
     "pkg/BUILD:3:28", "must be a neuron_model target, but '//pkg:t' is a neuron_target"),
    ("cycle", {"pkg/BUILD": 'compiler_options(name = "a", deps = [":b"])\ncompiler_options(name = "b", deps = [":a"])\n'},
     "pkg/BUILD:", "dependency cycle: //pkg:a -> //pkg:b -> //pkg:a"),
    ("syntax", {"pkg/BUILD": 'neuron_target(name = "t",\n  platform = )\n'}, "pkg/BUILD:2:", "syntax error"),
    ("undefined_name", {"pkg/BUILD": 'x = 1\nneuron_targett(name = "t", platform = "trn2")\n'}, "pkg/BUILD:2:1",
     "undefined: neuron_targett"),
    ("load_missing_file", {"pkg/BUILD": 'load("//tools:nope.bzl", "m")\n'}, "pkg/BUILD:1:1",
     "cannot load '//tools:nope.bzl'"),
    ("load_missing_symbol", {"pkg/BUILD": '\nload("//tools:defs.bzl", "nope")\n', "tools/defs.bzl": "def m():\n    pass\n"},
     "pkg/BUILD:2:1", "does not define 'nope'"),
    ("load_private", {"pkg/BUILD": 'load("//tools:defs.bzl", "_m")\n', "tools/defs.bzl": "def _m():\n    pass\n"},
     "pkg/BUILD:1:1", "private"),
    ("positional", {"pkg/BUILD": 'neuron_target("t", platform = "trn2")\n'}, "pkg/BUILD:1:14",
     "keyword arguments only"),
    ("missing_src", {"pkg/BUILD": MODEL}, "pkg/BUILD:1:26", "source file 'pkg/m.py' does not exist"),
    ("bad_label", {"pkg/BUILD": 'compiler_options(name = "o", deps = ["//bad::x"])\n'}, "pkg/BUILD:1:30",
     "invalid target name"),
    ("bad_input_spec", {"pkg/BUILD": MODEL.replace("int64[batch, seq]", "int64<batch>"), **SRC}, "pkg/BUILD:1:62",
     "must look like 'int64[batch, seq]'"),
    ("bad_entry", {"pkg/BUILD": MODEL.replace("m:build", "m.build"), **SRC}, "pkg/BUILD:1:43",
     "'entry' must look like 'module:function'"),
    ("isa_on_neuron", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2", isa = "x86-64-v3")\n'},
     "pkg/BUILD:1:46", "applies to platform 'cpu' only"),
    ("dims_and_shapes", {"pkg/BUILD": 'neuron_buckets(name = "b", dims = {"b": [1]}, shapes = [{"b": 1}])\n'},
     "pkg/BUILD:1:15", "exactly one of 'dims' and 'shapes'"),
    ("fail_in_macro", {"pkg/BUILD": 'load("@neuronbuild//rules:llm.bzl", "llm_compile")\n\nllm_compile(name = "x", '
                       'model = ":m", buckets = [], targets = [])\n'}, "pkg/BUILD:3:12", "targets must be non-empty"),
    ("macro_bad_attr", {"pkg/BUILD": 'load("//tools:defs.bzl", "mk")\nmk()\n',
                        "tools/defs.bzl": 'def mk():\n    neuron_target(name = "t", platform = "trn2", bogus = 1)\n'},
     "pkg/BUILD:2:3", "unknown attribute 'bogus'"),
    ("load_cycle", {"pkg/BUILD": 'load("//tools:a.bzl", "a")\n', "tools/a.bzl": 'load(":b.bzl", "b")\na = 1\n',
                    "tools/b.bzl": 'load(":a.bzl", "a")\nb = 1\n'}, "tools/b.bzl:1:1", "load cycle"),
    ("bucket_dims_mismatch", {"pkg/BUILD": MODEL + 'neuron_target(name = "t", platform = "trn2")\n'
                              'neuron_buckets(name = "b", shapes = [{"batch": 1}])\n'
                              'neuron_compile(name = "c", model = ":m", buckets = [":b"], target = ":t")\n', **SRC},
     "pkg/BUILD:4:15", "has no size for dimension 'seq'"),
    ("nearest_label", {"pkg/BUILD": MODEL + 'neuron_target(name = "trn2", platform = "trn2")\n'
                       'neuron_compile(name = "c", model = ":m", buckets = [],\n    target = ":tnr2")\n', **SRC},
     "pkg/BUILD:4:5", "which does not exist (not declared there; did you mean ':trn2'?)"),
    ("nearest_attr_is_the_missing_required_one", {"pkg/BUILD": MODEL.replace("inputs =", "input ="), **SRC},
     "pkg/BUILD:1:", "unknown attribute 'input' (did you mean 'inputs'?)"),
    ("undefined_macro_names_its_load", {"pkg/BUILD": 'hf_causal_lm(name = "x", config = {}, weights = "w")\n'},
     "pkg/BUILD:1:1", 'undefined: hf_causal_lm (load("@neuronbuild//rules:llm.bzl", "hf_causal_lm") provides it)'),
    ("tp_degree_zero", {"pkg/BUILD": MODEL + 'neuron_target(name = "t", platform = "trn2")\n'
                        'neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8]})\n'
                        'neuron_compile(name = "c", model = ":m", buckets = [":b"], target = ":t", tp_degree = 0)\n', **SRC},
     "pkg/BUILD:4:75:", "attribute 'tp_degree' must be a positive int"),
    ("tp_degree_bool", {"pkg/BUILD": MODEL + 'neuron_target(name = "t", platform = "trn2")\n'
                        'neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8]})\n'
                        'neuron_compile(name = "c", model = ":m", buckets = [":b"], target = ":t", tp_degree = True)\n', **SRC},
     "pkg/BUILD:4:75:", "attribute 'tp_degree' must be an int, got bool"),
    ("hf_zero_heads", {"pkg/BUILD": 'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")\n'
                       'hf_causal_lm(name = "lm", weights = "w.safetensors",\n'
                       '    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 0, "num_key_value_heads": 1})\n'},
     "pkg/BUILD:2:13", "config field num_attention_heads must be a positive int, got 0"),
    ("hf_bool_hidden", {"pkg/BUILD": 'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")\n'
                       'hf_causal_lm(name = "lm", weights = "w.safetensors",\n'
                       '    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": True, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})\n'},
     "pkg/BUILD:2:13", "config field hidden_size must be a positive int, got True"),
    ("hf_absurd_layers", {"pkg/BUILD": 'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")\n'
                       'hf_causal_lm(name = "lm", weights = "w.safetensors",\n'
                       '    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1000000, "num_attention_heads": 4, "num_key_value_heads": 2})\n'},
     "pkg/BUILD:2:13", "num_hidden_layers is 1000000, more than 1024"),
    ("hf_heads_not_divisible", {"pkg/BUILD": 'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")\n'
                       'hf_causal_lm(name = "lm", weights = "w.safetensors",\n'
                       '    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3})\n'},
     "pkg/BUILD:2:13", "num_key_value_heads (3) must divide num_attention_heads (4)"),
    ("hf_too_many_params", {"pkg/BUILD": 'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")\n'
                       'hf_causal_lm(name = "lm", weights = "w.safetensors",\n'
                       '    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 1000000, "intermediate_size": 64, "num_hidden_layers": 100, "num_attention_heads": 4, "num_key_value_heads": 2})\n'},
     "pkg/BUILD:2:13", "more than any host could hold"),
    ("hf_unknown_model_type", {"pkg/BUILD": 'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")\n'
                               'hf_causal_lm(name = "lm", weights = "w.safetensors", config = {"model_type": "qwen-3", '
                               '"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4})\n'
                               'llm_buckets(name = "b", batch_sizes = [1], context_lengths = [8])\n'
                               'neuron_target(name = "t", platform = "trn2")\n'
                               'neuron_compile(name = "c", model = ":lm", target = ":t",\n'
                               '               buckets = {"context": [":b_context"], "token": [":b_token"]})\n',
                               "pkg/w.safetensors": ""},
     "pkg/BUILD:2:13", "config field model_type: 'qwen-3' is not a model type the installed transformers knows "
                       "(did you mean 'qwen3'"),
    ("unloaded_bzl_name", {"pkg/BUILD": 'load("//tools:defs.bzl", "mk")\nhelper()\n',
                           "tools/defs.bzl": "def helper():\n    pass\ndef mk():\n    helper()\n"},
     "pkg/BUILD:2:1", "name 'helper' is not defined"),
]


@pytest.mark.parametrize("case_id,files,where,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_build_input_is_one_line_with_location(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, case_id: str,
                                                   files: dict[str, str], where: str, fragment: str) -> None:
    ws = write_ws(tmp_path / "ws", files)
    monkeypatch.chdir(ws)
    code = main(["build", "//pkg:all", "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(where), err
    assert re.match(r"^[^:]+:\d+:\d+: error: ", lines[0]), err
    assert fragment in lines[0], err


def test_bad_input_through_the_real_command_has_no_traceback(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": 'neuron_target(name = "t", platform = 3)\n'})
    proc = run_cli(["build", "//pkg:t", "--cache-dir", str(tmp_path / "c")], ws)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "pkg/BUILD:1:27: error: attribute 'platform' must be a string, got int"
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,fragment", [
    (["build", "//pkg:missing"], "no such target '//pkg:missing'"),
    (["build", "//nowhere:x"], "no such package 'nowhere'"),
    (["build", "//pkg::x"], "bad target pattern"),
    (["build", "--jobs", "0"], "--jobs must be at least 1"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_command_line_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch, args: list[str], fragment: str) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2")\n'})
    monkeypatch.chdir(ws)
    assert main([*args, "--cache-dir", str(tmp_path / "c")] if args[0] == "build" else args) == 2
    assert fragment in capsys.readouterr().err


def test_outside_a_workspace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["build", "//..."]) == 2
    assert "not inside a neuronbuild workspace" in capsys.readouterr().err
