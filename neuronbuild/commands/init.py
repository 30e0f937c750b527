"""`neuronbuild init [DIR]`: a new workspace that builds as it is (a marker, one model, buckets, a cpu and a trn2
target), to replace the model of with one's own."""

from __future__ import annotations

import argparse

from neuronbuild import streams
from neuronbuild.commands.common import bad_input
from neuronbuild.errors import EXIT_OK

PACKAGE = "models"

BUILD = '''\
# A neuronbuild package, made by `neuronbuild init`. Build it: `neuronbuild build` (= //...), or one target:
# `neuronbuild build //models:tiny_cpu`. See what would run first: `neuronbuild plan`.
# Every rule and attribute: BUILD.example in neuronbuild's repository; what a model may declare: docs/models.md.

neuron_model(
    name = "tiny",
    srcs = ["model.py"],                    # the model's Python sources (the only files its factory may read)
    entry = "model:build",                  # model.py's build(config) returns the torch.nn.Module (put in eval mode)
    config = {"features": 16, "hidden": 32},  # passed to build(config)
    inputs = {"x": "float32[batch, 16]"},   # positional inputs of forward(), in order; `batch` is a bucket dim
    # weights = "tiny.safetensors",         # trained weights; from a state dict:
    #                                       #   neuronbuild weights convert tiny.pt models/tiny.safetensors
)

# The static shapes compiled: one graph per bucket (here batch 1 and batch 4). Calls are routed to the smallest
# bucket that fits and padded up to it; a larger batch runs in bucket-sized chunks.
neuron_buckets(
    name = "serving",
    dims = {"batch": [1, 4]},
)

neuron_target(name = "cpu", platform = "cpu")    # AOTInductor, for this machine's CPU
neuron_target(name = "trn2", platform = "trn2")  # AWS Trainium2: HLO for neuronx-cc (NEFFs when it is installed)

neuron_compile(name = "tiny_cpu", model = ":tiny", buckets = [":serving"], target = ":cpu")
neuron_compile(name = "tiny_trn2", model = ":tiny", buckets = [":serving"], target = ":trn2")

# A release to ship (docs/deploy.md): neuronbuild-out/models/release_cpu.tar.zst, installed on a serving host with
# `neuronbuild deploy neuronbuild-out/models/release_cpu.tar.zst --dest /srv/models` and loaded there with
# neuronbuild.runtime.open_cache("/srv/models", strict=True) (no compiling). A bundle of Neuron targets needs their
# NEFFs (neuronx-cc).
neuron_bundle(name = "release_cpu", srcs = [":tiny_cpu"])
'''

MODEL = '''\
"""A tiny model to start from: replace it with yours (docs/models.md).

neuronbuild calls build(config) with the neuron_model's `config`, puts the module in eval mode, and traces it at
each bucket of its neuron_compile targets with the inputs the BUILD file declares, in that order."""

import torch


class TinyMLP(torch.nn.Module):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(features, hidden)
        self.down = torch.nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build(config: dict) -> torch.nn.Module:
    return TinyMLP(config["features"], config["hidden"])
'''

MARKER_TEXT = "# The root of a neuronbuild workspace (labels start here: //models:tiny_cpu is models/BUILD's tiny_cpu).\n"
GITIGNORE = "neuronbuild-out/\n"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("init", help="start a workspace: a marker, a BUILD file with one model and a tiny model that "
                                    "builds for cpu and trn2")
    p.add_argument("dir", nargs="?", default=".", metavar="DIR", help="where (default: the current directory)")


def files() -> dict[str, str]:
    """The files `init` writes, by path relative to the new workspace's root."""
    from neuronbuild.workspace import BUILD_FILE, MARKER

    return {MARKER: MARKER_TEXT, f"{PACKAGE}/{BUILD_FILE}": BUILD, f"{PACKAGE}/model.py": MODEL, ".gitignore": GITIGNORE}


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from neuronbuild import command
    from neuronbuild.workspace import MARKER

    cmd = command.current()
    shown_root = Path(args.dir)  # (as given, in messages)
    root = cmd.path(args.dir)  # (the command's directory, not the process's)

    def show(p: Path) -> Path:
        return shown_root / p.relative_to(root) if p.is_relative_to(root) else p

    if root.exists() and not root.is_dir():
        return bad_input(f"{shown_root} exists and is not a directory")
    todo = files()
    if (root / ".gitignore").exists():
        del todo[".gitignore"]  # (a project's own: left as it is)
    real_root = root.resolve()
    for rel in todo:  # (a directory on the way that is a symlink leading out would take the files elsewhere)
        parent = (root / rel).parent
        if parent.exists() and not parent.resolve().is_relative_to(real_root):
            return bad_input(f"{show(parent)} leads outside {shown_root} (to {parent.resolve()}); init writes only "
                             "inside the new workspace")
    there = [rel for rel in todo if (root / rel).exists() or (root / rel).is_symlink()]
    if there:
        what = "is already a workspace" if MARKER in there else f"already has {', '.join(there)}"
        return bad_input(f"{shown_root} {what}; init writes only new files (choose another DIR)")
    for rel, text in todo.items():
        path = root / rel
        made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in made:  # the command's umask, not the process's (a build server's is its own)
            os.chmod(d, cmd.mode(0o777))
        with open(path, "x", encoding="utf-8") as f:  # never overwrite, even what appeared meanwhile
            os.fchmod(f.fileno(), cmd.mode())
            f.write(text)
    shown = "." if str(args.dir) == "." else str(args.dir)
    print(f"Created a neuronbuild workspace in {shown}:", file=streams.out())
    print(f"  {MARKER:<22} marks the workspace root", file=streams.out())
    print(f"  {PACKAGE}/BUILD{'':<{16 - len(PACKAGE)}} one model, its buckets (batch 1 and 4), a cpu and a trn2 target, "
          "a cpu release bundle", file=streams.out())
    print(f"  {PACKAGE}/model.py{'':<{13 - len(PACKAGE)}} a tiny model: replace it with yours (docs/models.md)", file=streams.out())
    cd = "" if shown == "." else f"cd {shown} && "
    print(f"Next: {cd}neuronbuild build   (outputs in neuronbuild-out/{PACKAGE}/; `neuronbuild plan` shows what "
          "would run)", file=streams.out())
    return EXIT_OK
