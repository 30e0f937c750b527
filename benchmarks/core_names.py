"""Issue #32's measure: lines of core code that name a built-in toolchain, platform or rule kind.

Core code: every neuronbuild/**.py outside toolchains/ and kinds/ (their own modules) and the shared names and
registrations (vocabulary.py, platforms.py, plugins.py). A line counts when it quotes a built-in platform, toolchain,
artifact format, compiler or rule-kind name, or names the neuronx-cc plumbing; comment lines do not count. Lines that
match without naming a toolchain (a starter BUILD file's text, JAX's "cpu" backend, torch's "cpu" device, a docstring
example) are listed in NOT_NAMING with why, and reported apart.

    .venv/bin/python benchmarks/core_names.py [--list] [--package DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "neuronbuild"
OWN = ("toolchains/", "kinds/")  # a toolchain's or kind's own modules
SHARED = ("vocabulary.py", "platforms.py", "plugins.py")  # the shared names and the registrations
_NAMES = (r"aoti|neuron-hlo|cpu|trn[123]|inf[12]|neuronx-cc|cxx|g\+\+|c\+\+|neuron_model|neuron_compile|"
          r"neuron_bundle|neuron_target|neuron_buckets|compiler_options|py_library")
PATTERN = re.compile(rf"""["']({_NAMES})["']|NeuronxCc|neuronx_cc|NEURONX|AOTI_FORMAT|NEURON_HLO_FORMAT|"""
                     r"VOLATILE_KINDS|toolchains\.compile")
# (file, text the line holds): matched, but naming no toolchain, platform or kind of the build (why)
NOT_NAMING = (
    ("commands/init.py", "neuron_target(name ="),  # the starter BUILD file `init` writes (user text)
    ("runtime/xla_cpu.py", '"cpu"'),  # JAX's CPU backend (XLA:CPU), not the cpu platform
    ("runtime/inputs.py", 'device.type != "cpu"'),  # torch's CPU device
    ("noop.py", '"cpu": _cpu_flags()'),  # the host's CPU flags in the no-op stamp
    ("analysis/providers.py", "e.g."),  # an example in a field's comment
    ("plugin_api/toolchain.py", "e.g."),  # docstring examples
    ("plugin_api/flag.py", "(`--neuronx-cc` -> `neuronx_cc`)"),  # a docstring's example of a flag's dest
    ("analysis/explain.py", "toolchain 'aoti'"),  # a docstring's example message
)


def matches(pkg: Path = PKG) -> list[tuple[str, int, str, bool]]:
    """(file, line number, line, names a toolchain) of every matching non-comment core line of package dir `pkg`."""
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if rel.startswith(OWN) or rel in SHARED:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("#") or not PATTERN.search(line):
                continue
            naming = not any(rel == f and text in line for f, text in NOT_NAMING)
            out.append((rel, n, line.strip(), naming))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print every matching line")
    p.add_argument("--package", type=Path, default=PKG, help="the neuronbuild package directory to count (default: "
                   "this checkout's; e.g. one from `git archive`)")
    args = p.parse_args(argv)
    found = matches(args.package)
    naming = [m for m in found if m[3]]
    if args.list:
        for rel, n, line, is_naming in found:
            print(f"{'  ' if is_naming else '- '}{rel}:{n}: {line}")
    files = sorted({m[0] for m in naming})
    print(f"{len(naming)} core lines in {len(files)} files name a built-in toolchain, platform or kind "
          f"({len(found) - len(naming)} more match without naming one)")
    for f in files:
        print(f"  {f}: {sum(1 for m in naming if m[0] == f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
