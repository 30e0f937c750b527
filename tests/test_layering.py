"""The phases' import order, enforced: loading -> analysis -> (rule kinds, toolchains) -> execution -> cache ->
packaging, with runtime a production island and commands never importing each other. Every import counts, lazy
ones inside functions included (only `if TYPE_CHECKING:` blocks are exempt from the layers: they never run). No
import circle among neuronbuild's modules, counting those blocks too and the modules the plug-in registry imports
by name (plugins.BUILTIN, runtime/loaders.RUNTIME_BUILTIN, ...: in a module importing by name, every string naming a
neuronbuild module)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "neuronbuild"

# What each part of neuronbuild may import besides itself (the base layer: errors, workspace, atomic, digests,
# platforms, vocabulary, history, plugins and the plug-in API, engine, envvars, streams).
BASE = {"__init__", "errors", "workspace", "atomic", "digests", "platforms", "vocabulary", "history",
        "plugins", "plugin_api", "self_stamp", "jsondata", "engine", "envvars", "streams"}
ALLOWED = {
    "base": set(),
    "loading": set(),
    "analysis": {"loading"},
    "runtime": set(),  # production: imports nothing of the build side
    "kinds": {"loading", "analysis"},
    "toolchains": {"loading", "analysis", "runtime"},
    "execution": {"loading", "analysis", "toolchains"},  # the cache only through execution/cache_api.py
    "cache": set(),  # implements execution's cache interface without importing it, and never analysis
    "packaging": {"loading", "analysis", "cache", "runtime"},
    "top": {"loading", "analysis", "kinds", "toolchains", "execution", "cache", "packaging", "runtime"},
}
TOP = {"__main__", "build", "cli", "command", "context", "incremental", "noop", "after_answer", "commands", "rcfile", "completion",
       "clean", "server", "report"}


def part(module: str) -> str:
    """'neuronbuild.cache.gc' -> 'cache'; base modules -> 'base'; build.py, cli.py ... -> 'top'."""
    rest = module.split(".")[1:]
    if not rest:
        return "base"
    if rest[0] in BASE:
        return "base"
    if rest[0] in TOP:
        return "top"
    return rest[0]


def _runtime_imports(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            pkg_dir = PKG.parent.joinpath(*name.split("."))
            out.extend((node.lineno, f"{name}.{a.name}") for a in node.names  # `from pkg import submodule`
                       if (pkg_dir / f"{a.name}.py").is_file() or (pkg_dir / a.name).is_dir())
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _modules() -> list[tuple[str, Path]]:
    out = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out.append((name, p))
    return out


def test_every_import_runs_the_way_the_phases_do() -> None:
    bad = []
    for module, path in _modules():
        src = part(module)
        for line, imported in _runtime_imports(ast.parse(path.read_text()), module):
            if not imported.startswith("neuronbuild.") and imported != "neuronbuild":
                continue
            dst = part(imported)
            if dst in ("base", src) or dst in ALLOWED[src]:
                if src == "execution" and dst == "cache":
                    bad.append(f"{path.name}:{line}: {module} imports {imported}")
                continue
            bad.append(f"{path.relative_to(PKG.parent)}:{line}: {module} ({src}) imports {imported} ({dst})")
    assert not bad, "\n".join(bad)


def test_no_command_module_imports_another() -> None:
    bad = []
    for module, path in _modules():
        if not module.startswith("neuronbuild.commands.") or module.endswith(".common"):
            continue
        for line, imported in _runtime_imports(ast.parse(path.read_text()), module):
            if imported.startswith("neuronbuild.commands.") and not imported.endswith(".common"):
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: imports {imported}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_violations() -> None:
    tree = ast.parse("def f():\n    from neuronbuild.analysis.planner import plan\n")
    assert _runtime_imports(tree, "neuronbuild.cache.gc") == [(2, "neuronbuild.analysis.planner")]
    assert part("neuronbuild.cache.gc") == "cache" and "analysis" not in ALLOWED["cache"]
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import neuronbuild.cache.local\n")
    assert [n for _l, n in _runtime_imports(guarded, "neuronbuild.execution.x") if n.startswith("neuronbuild")] == []


def _structure_imports(tree: ast.AST, module: str, names: set[str]) -> list[str]:
    """Every module `module` depends on: its imports, `if TYPE_CHECKING:` ones included, and, in a module importing
    by name (importlib.import_module: the plug-in registry's loading, the runtime's loaders), every string constant
    naming a neuronbuild module (plugins.BUILTIN, runtime/loaders.RUNTIME_BUILTIN, ...)."""
    out = [n for _line, n in _runtime_imports(tree, module)]
    by_name = "import_module(" in ast.unparse(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                out.extend(n for _line, n in _runtime_imports(child, module))
        elif by_name and isinstance(node, ast.Constant) and node.value in names:
            out.append(node.value)
    return out


def _import_graph() -> dict[str, set[str]]:
    names = {m for m, _p in _modules()}
    edges: dict[str, set[str]] = {}
    for module, path in _modules():
        for imported in _structure_imports(ast.parse(path.read_text()), module, names):
            target = imported
            while target and target not in names:  # `from neuronbuild.x import name` -> module neuronbuild.x
                target = target.rpartition(".")[0]
            parent_pkg = module.rpartition(".")[0]
            if target and target != module and target != parent_pkg and not module.startswith(target + "."):
                edges.setdefault(module, set()).add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in edges.items() for b in bs])
    return [c for c in nx.simple_cycles(g) if len(c) > 1]


def test_no_import_circle_among_modules_counting_type_checking_and_registry_names() -> None:
    edges = _import_graph()
    # the registry's names are edges: the plug-in list reaches the kinds, the runtime's the loaders
    assert "neuronbuild.kinds" in edges["neuronbuild.plugins"]
    assert "neuronbuild.toolchains.cpu_runtime" in edges["neuronbuild.runtime.loaders"]
    cycles = _cycles(edges)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles[:10])


def test_the_circle_check_sees_a_type_level_circle_and_a_registry_name() -> None:
    names = {"neuronbuild.a", "neuronbuild.b"}
    a = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from neuronbuild.b import B\n")
    b = ast.parse('import importlib\nPLUGINS = ("neuronbuild.a",)\nimportlib.import_module(PLUGINS[0])\n')
    edges = {"neuronbuild.a": set(_structure_imports(a, "neuronbuild.a", names)),
             "neuronbuild.b": set(_structure_imports(b, "neuronbuild.b", names))}
    assert _cycles(edges) != []


def test_the_plug_in_api_imports_only_the_base_layer() -> None:
    """The protocols plug-ins implement and the plain data they mention sit at the base (plugin_api/): at run time
    they import nothing above it (the value types they name only for type checking are leaves: the circle test)."""
    bad = [f"{path.name}:{line}: {imported}" for module, path in _modules() if module.startswith("neuronbuild.plugin_api")
           for line, imported in _runtime_imports(ast.parse(path.read_text()), module)
           if imported.startswith("neuronbuild.") and part(imported) != "base"]
    assert bad == []


def test_no_core_module_names_a_built_in_toolchain_platform_or_kind() -> None:
    """Issue #32's measure, held at 0: outside toolchains/, kinds/ and the shared names (vocabulary, platforms,
    plugins), no line names a built-in toolchain, platform or kind (benchmarks/core_names.py; lines that match
    without naming one are listed there with why)."""
    import sys

    sys.path.insert(0, str(PKG.parent / "benchmarks"))
    try:
        import core_names
    finally:
        sys.path.remove(str(PKG.parent / "benchmarks"))
    naming = [f"{f}:{n}: {line}" for f, n, line, is_naming in core_names.matches(PKG) if is_naming]
    assert naming == [], "\n".join(naming)
    # and the counter sees one when there is one (main's no-op tool list, the former tp table)
    assert core_names.PATTERN.search('TOOLS = ("g++", "c++", "neuronx-cc")')
    assert core_names.PATTERN.search('    "trn2": (1, 2, 4, 8, 16, 32, 64),')
