"""`neuronbuild query` on the example and on a generated multi-package workspace, against hand-computed answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import copy_example, run_cli, write_ws

from neuronbuild.analysis.query import QueryError, load_query_graph, parse_query, patterns_of, run_query

M = "//models:"


def _q(root: Path, expr: str) -> set[str]:
    return set(run_query(root, expr)[1])


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example workspace without examples/hf (its transformers models are tests/test_models_hf.py's)."""
    return copy_example(tmp_path_factory.mktemp("query") / "ws")


@pytest.mark.parametrize("expr,expected", [
    ("deps(//models:llama_trn2)", {"llama_trn2", "llama", "llama.safetensors", "serve_context", "serve_token", "trn2",
                                   "context_opts", "token_opts", "base"}),
    ("deps(//models:llama_trn2, 1)", {"llama_trn2", "llama", "serve_context", "serve_token", "trn2", "context_opts",
                                      "token_opts"}),
    # (patterns include the manual llama_trn2_tp2, as in Bazel's query)
    ("rdeps(//..., //models:llama.safetensors)", {"llama.safetensors", "llama", "llama_trn2", "llama_cpu", "release",
                                                  "release_cpu", "llama_trn2_tp2"}),
    ("rdeps(//models:llama_cpu, //models:llama.safetensors)", {"llama.safetensors", "llama", "llama_cpu"}),
    ("kind(neuron_compile, //...)", {"llama_trn2", "llama_cpu", "llama_tiny_cpu", "llama_trn2_tp2"}),
    ("kind('source file', deps(//...))", {"llama.py", "llama_tiny.safetensors", "llama.safetensors"}),
    ("attr(platform, cpu, //...)", {"cpu"}),
    ("attr(opt_level, 1, //...)", {"context_opts"}),
    ("kind(neuron_compile, rdeps(//..., //tools:cpu_default))", {"llama_cpu"}),
    ("rdeps(//..., //tools:cpu_default)", {"llama_cpu", "release", "release_cpu", "//tools:cpu_default"}),
    ("kind(neuron_compile, //...) ^ rdeps(//..., //models:serve_token)", {"llama_trn2", "llama_cpu",
                                                                           "llama_trn2_tp2"}),
    ("kind(neuron_compile, //...) - attr(target, trn2, //...)", {"llama_cpu", "llama_tiny_cpu"}),
    ("set(//models:trn2 //models:cpu) union //models:base", {"trn2", "cpu", "base"}),
    ("allpaths(//models:llama_trn2, //models:base)", {"llama_trn2", "context_opts", "token_opts", "base"}),
    ("somepath(//models:llama_tiny_cpu, //models:llama.py)", {"llama_tiny_cpu", "llama_tiny", "llama.py"}),
    ("labels(buckets, //models:llama_trn2)", {"serve_context", "serve_token"}),  # a per-graph dict: every label
    ("labels(options, //models:llama_trn2)", {"context_opts", "token_opts"}),
])
def test_queries_on_the_example(expr: str, expected: set[str], example: Path) -> None:
    assert _q(example, expr) == {n if n.startswith("//") else f"{M}{n}" for n in expected}


def _multi(root: Path) -> Path:
    """common <- opts/fast; models/a, models/b, models/c; serve/x (a, fast), serve/y (b, base), serve/z (c, manual)."""
    model = 'neuron_model(name = "{n}", srcs = ["{n}.py"], entry = "{n}:build", inputs = {{"x": "float32[b]"}})\n'
    return write_ws(root, {
        "common/BUILD": 'neuron_target(name = "trn2", platform = "trn2")\n'
                        'compiler_options(name = "base", opt_level = 3)\n'
                        'neuron_buckets(name = "bk", dims = {"b": [1, 2]})\n',
        "opts/fast/BUILD": 'compiler_options(name = "fast", deps = ["//common:base"], opt_level = 1)\n',
        **{f"models/{n}/BUILD": model.format(n=n) for n in "abc"},
        **{f"models/{n}/{n}.py": "def build(config):\n    pass\n" for n in "abc"},
        "models/a/unused.py": "",
        "serve/x/BUILD": 'neuron_compile(name = "x", model = "//models/a:a", buckets = ["//common:bk"], '
                         'target = "//common:trn2", options = "//opts/fast:fast")\n',
        "serve/y/BUILD": 'neuron_compile(name = "y", model = "//models/b:b", buckets = ["//common:bk"], '
                         'target = "//common:trn2", options = "//common:base")\n',
        "serve/z/BUILD": 'neuron_compile(name = "z", model = "//models/c:c", buckets = ["//common:bk"], '
                         'target = "//common:trn2", tags = ["manual"])\n',
    })


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _multi(tmp_path_factory.mktemp("multi") / "ws")


@pytest.mark.parametrize("expr,expected", [
    ("//serve/...", {"//serve/x:x", "//serve/y:y", "//serve/z:z"}),
    ("rdeps(//..., //common:base)", {"//common:base", "//opts/fast:fast", "//serve/x:x", "//serve/y:y"}),
    ("rdeps(//..., //common:base, 1)", {"//common:base", "//opts/fast:fast", "//serve/y:y"}),
    # Only //serve/... is named: z's model package is loaded through z (a manual target) all the same.
    ("kind('source file', deps(//serve/...))", {"//models/a:a.py", "//models/b:b.py", "//models/c:c.py"}),
    ("deps(//serve/z:z)", {"//serve/z:z", "//models/c:c", "//models/c:c.py", "//common:bk", "//common:trn2"}),
    ("rdeps(//serve/..., //common:trn2) - //common:all", {"//serve/x:x", "//serve/y:y", "//serve/z:z"}),
    ("attr(opt_level, 3, //...)", {"//common:base"}),
    ("attr(deps, '//common:base', //...)", {"//opts/fast:fast"}),
    ("filter('^//models/', deps(//serve/x:x))", {"//models/a:a", "//models/a:a.py"}),
    ("allpaths(//serve/..., //common:base)", {"//serve/x:x", "//serve/y:y", "//opts/fast:fast", "//common:base"}),
    ("rdeps(//..., //models/a:unused.py)", set()),  # a file nothing references is outside the universe
    ("(//serve/x:x + //serve/y:y) ^ rdeps(//..., //opts/fast:fast)", {"//serve/x:x"}),
    ("//models/... except kind(neuron_model, //models/a:all)", {"//models/b:b", "//models/c:c"}),
])
def test_queries_on_a_generated_multi_package_workspace(multi: Path, expr: str, expected: set[str]) -> None:
    assert _q(multi, expr) == expected


def test_output_formats(multi: Path) -> None:
    proc = run_cli(["query", "deps(//serve/x:x)"], multi)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == sorted(proc.stdout.splitlines()) and len(proc.stdout.splitlines()) == 7
    items = json.loads(run_cli(["query", "deps(//serve/x:x)", "--output", "json"], multi).stdout)
    by = {i["label"]: i for i in items}
    assert by["//serve/x:x"]["kind"] == "neuron_compile" and by["//models/a:a.py"]["kind"] == "source file"
    assert by["//serve/x:x"]["attrs"]["options"] == "//opts/fast:fast"
    assert by["//opts/fast:fast"]["deps"] == ["//common:base"]
    dot = run_cli(["query", "allpaths(//serve/x:x, //common:base)", "--output", "graph"], multi).stdout
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    edges = {ln.strip() for ln in dot.splitlines() if "->" in ln}
    assert edges == {'"//serve/x:x" -> "//opts/fast:fast";', '"//opts/fast:fast" -> "//common:base";'}


@pytest.mark.parametrize("expr,message", [
    ("deps(//serve/x:nope)", "no such target or source file '//serve/x:nope'"),
    ("deps(//serve/x:x", "expected ')'"),
    ("frobnicate(//...)", "unknown function 'frobnicate'"),
    ("deps(//..., two)", "depth must be a non-negative integer"),
    ("kind('(', //...)", "bad regular expression"),
    ("//... +", "unexpected end of expression"),
    ("deps(" * 5000 + "//..." + ")" * 5000, "nests parentheses and calls more than 100 deep"),
    ("(" * 5000 + "//..." + ")" * 5000, "nests parentheses and calls more than 100 deep"),
], ids=["missing", "unclosed", "unknown_function", "bad_depth", "bad_regex", "dangling_op", "deep_calls",
        "deep_parens"])
def test_bad_queries_are_one_line_errors(multi: Path, expr: str, message: str) -> None:
    proc = run_cli(["query", expr], multi)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_chain_of_thousands_of_set_operators_is_evaluated_without_recursion(multi: Path) -> None:
    proc = run_cli(["query", " + ".join(["//serve/x:x"] * 5000) + " - //serve/x:x + //common:base"], multi)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["//common:base"]


def test_parser_precedence_is_left_to_right() -> None:
    node = parse_query("a - b + c")
    assert node.value == "union" and node.args[0].value == "except"
    assert patterns_of(parse_query("rdeps(//..., set(//a:b //c:d))")) == ["//...", "//a:b", "//c:d"]
    with pytest.raises(QueryError):
        parse_query("")


def test_query_graph_holds_exactly_the_targets_files_and_references(multi: Path) -> None:
    """The graph query evaluates over, against the hand-drawn graph of the multi-package workspace."""
    qg = load_query_graph(multi, ["//..."])
    kinds = {
        "//common:trn2": "neuron_target", "//common:base": "compiler_options", "//common:bk": "neuron_buckets",
        "//opts/fast:fast": "compiler_options",
        **{f"//models/{n}:{n}": "neuron_model" for n in "abc"},
        **{f"//models/{n}:{n}.py": "source file" for n in "abc"},  # unused.py: referenced by nothing, not a node
        **{f"//serve/{n}:{n}": "neuron_compile" for n in "xyz"},
    }
    edges = {
        ("//opts/fast:fast", "//common:base"),
        *((f"//models/{n}:{n}", f"//models/{n}:{n}.py") for n in "abc"),
        ("//serve/x:x", "//models/a:a"), ("//serve/x:x", "//common:bk"), ("//serve/x:x", "//common:trn2"),
        ("//serve/x:x", "//opts/fast:fast"),
        ("//serve/y:y", "//models/b:b"), ("//serve/y:y", "//common:bk"), ("//serve/y:y", "//common:trn2"),
        ("//serve/y:y", "//common:base"),
        ("//serve/z:z", "//models/c:c"), ("//serve/z:z", "//common:bk"), ("//serve/z:z", "//common:trn2"),
    }
    assert set(qg.graph.nodes) == set(kinds)
    assert set(qg.graph.edges) == edges  # from a target to what it references, nothing else
    assert dict(qg.kinds) == kinds
    assert qg.manual == {"//serve/z:z"}
    assert qg.attrs["//common:base"]["opt_level"] == 3 and qg.attrs["//opts/fast:fast"]["opt_level"] == 1
