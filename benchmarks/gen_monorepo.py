"""Writes a synthetic monorepo in the real BUILD language: packages of tiny models, bucket sets, targets, option sets and
compile targets, half of them declared through load()ed macros.

One "graph" is one compiled graph: a (model, bucket, compile target) triple, i.e. one compile action. Each package
holds one model (a seeded nn.Linear + ReLU), one bucket set of `buckets` shapes and `compiles` neuron_compile targets
(Neuron platforms only, so filling the cache uses the seconds-long CPU-compile path), so a package contributes
buckets x compiles graphs and `buckets` trace actions.

    python benchmarks/gen_monorepo.py OUT --graphs 1000 [--buckets 2 --compiles 2]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

# (platform, option set) of the i-th compile target of a package.
COMPILE_KINDS = (("trn2", "fast"), ("trn1", "base"), ("trn2", "base"), ("inf2", "fast"), ("trn3", "base"),
                 ("trn1", "fast"), ("inf2", "base"), ("trn3", "fast"))
FEAT = 16
GROUP = 100  # packages per group directory (keeps directories small)

MODEL_PY = '''"""A tiny model for the synthetic monorepo."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def build(config):
    return Tiny(int(config["width"]))
'''

COMMON_BUILD = '''# Shared targets and option sets of the synthetic monorepo.
neuron_target(name = "trn1", platform = "trn1")
neuron_target(name = "trn2", platform = "trn2")
neuron_target(name = "trn3", platform = "trn3")
neuron_target(name = "inf2", platform = "inf2")

compiler_options(name = "base", opt_level = 2, model_type = "transformer")
compiler_options(name = "fast", deps = [":base"], opt_level = 1, auto_cast = "matmult")
'''

DEFS_BZL = '''"""Monorepo macros: load("//common:defs.bzl", "tiny_model", "tiny_compiles")."""

def tiny_model(name, width, seed = 0):
    """A neuron_model for this package's model.py."""
    neuron_model(
        name = name,
        srcs = ["model.py"],
        entry = "model:build",
        config = {"width": width},
        inputs = {"x": "float32[batch, feat]"},
        seed = seed,
    )

def tiny_compiles(name, model, buckets, kinds):
    """One neuron_compile per (platform, option set) in kinds, named <name>_<i>."""
    for i, kind in enumerate(kinds):
        neuron_compile(
            name = "%s_%d" % (name, i),
            model = model,
            buckets = buckets,
            target = "//common:" + kind[0],
            options = "//common:" + kind[1],
        )
'''


def package_name(i: int) -> str:
    return f"g{i // GROUP:03d}/p{i:05d}"


def batch_sizes(i: int, buckets: int) -> list[int]:
    return [1 + i % 3 + k for k in range(buckets)]


def build_file(i: int, buckets: int, compiles: int) -> str:
    kinds = [COMPILE_KINDS[(i + k) % len(COMPILE_KINDS)] for k in range(compiles)]
    batches = ", ".join(str(b) for b in batch_sizes(i, buckets))
    head = f'neuron_buckets(name = "shapes", dims = {{"batch": [{batches}], "feat": [{FEAT}]}})\n'
    if i % 2 == 0:  # through the load()ed macros
        body = ('load("//common:defs.bzl", "tiny_compiles", "tiny_model")\n\n'
                f'tiny_model(name = "m", width = {FEAT}, seed = {i})\n' + head +
                f'tiny_compiles(name = "c", model = ":m", buckets = [":shapes"], kinds = {kinds!r})\n')
        return body.replace("'", '"')
    lines = [f'neuron_model(name = "m", srcs = ["model.py"], entry = "model:build", config = {{"width": {FEAT}}},\n'
             f'             inputs = {{"x": "float32[batch, feat]"}}, seed = {i})\n', head]
    for k, (plat, opts) in enumerate(kinds):
        lines.append(f'neuron_compile(name = "c_{k}", model = ":m", buckets = [":shapes"], '
                     f'target = "//common:{plat}", options = "//common:{opts}")\n')
    return "".join(lines)


def generate(out: Path, graphs: int, buckets: int, compiles: int) -> int:
    """Write the workspace; returns the number of packages (excluding //common)."""
    per_pkg = buckets * compiles
    packages = max(1, graphs // per_pkg)
    if out.exists():
        shutil.rmtree(out)
    (out / "common").mkdir(parents=True)
    (out / "WORKSPACE.neuronbuild").write_text("")
    (out / "common" / "BUILD").write_text(COMMON_BUILD)
    (out / "common" / "defs.bzl").write_text(DEFS_BZL)
    for i in range(packages):
        d = out / package_name(i)
        d.mkdir(parents=True, exist_ok=True)
        (d / "BUILD").write_text(build_file(i, buckets, compiles))
        (d / "model.py").write_text(MODEL_PY)
    return packages


def edit_one_bucket_list(out: Path, i: int = 0, buckets: int = 2, new_size: int | None = None) -> str:
    """Change the largest batch size of package i's bucket set (to new_size, default +10); returns the package."""
    p = out / package_name(i) / "BUILD"
    old = batch_sizes(i, buckets)
    new = [*old[:-1], new_size if new_size is not None else old[-1] + 10]
    text = p.read_text()
    before = f'"batch": [{", ".join(map(str, old))}]'
    assert before in text, (before, text)
    p.write_text(text.replace(before, f'"batch": [{", ".join(map(str, new))}]'))
    return package_name(i)


def main() -> None:
    assert __doc__ is not None
    intro, details = __doc__.split("\n\n")[:2]  # the whole docstring, not its first line cut mid-sentence
    ap = argparse.ArgumentParser(description=intro, epilog=details.strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="directory to write the workspace into (replaced if it exists)")
    ap.add_argument("--graphs", type=int, default=1000, help="compiled graphs (compile actions) in total")
    ap.add_argument("--buckets", type=int, default=2, help="buckets per package")
    ap.add_argument("--compiles", type=int, default=2, help=f"compile targets per package (<= {len(COMPILE_KINDS)})")
    a = ap.parse_args()
    n = generate(a.out, a.graphs, a.buckets, min(a.compiles, len(COMPILE_KINDS)))
    print(f"{a.out}: {n} packages, {n * a.buckets * a.compiles} graphs, {n * a.buckets} traces")


if __name__ == "__main__":
    main()
