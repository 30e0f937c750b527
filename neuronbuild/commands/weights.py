"""`neuronbuild weights convert IN OUT.safetensors`: a torch checkpoint (or a sub-model of a larger checkpoint) to the
safetensors file a model loads."""

from __future__ import annotations

import argparse

from neuronbuild import streams
from neuronbuild.commands.common import bad_input
from neuronbuild.errors import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    w = sub.add_parser("weights", help="convert model weights: neuronbuild weights convert model.pt model.safetensors")
    ws = w.add_subparsers(dest="weights_command", required=True, metavar="SUBCOMMAND")
    c = ws.add_parser("convert", help="a torch state dict (.pt/.pth/.bin), or part of a .safetensors checkpoint, to a "
                                      ".safetensors file for `weights = ...`")
    c.add_argument("src", metavar="IN", help="a file saved with torch.save(model.state_dict(), ...) (or a checkpoint "
                                             "dict holding one under 'state_dict' or 'model'), or a .safetensors "
                                             "file or *.safetensors.index.json to take a sub-model's keys from")
    c.add_argument("dest", metavar="OUT", help="the .safetensors file to write (refused if it exists, unless --force)")
    c.add_argument("--allow-pickle", action="store_true",
                   help="also accept a whole pickled module (torch.save(model, ...)): unpickling runs code from the "
                        "file, so only for files you trust")
    c.add_argument("--prefix", default="",
                   help="keep only keys starting with this prefix, and strip it (e.g. 'model.', or 'model.encoder.' "
                        "to take a seq2seq model's encoder from the whole checkpoint)")
    c.add_argument("--drop", action="append", default=[], metavar="PREFIX",
                   help="leave out keys starting with PREFIX (repeatable; each must match a key), e.g. 'decoder.' "
                        "and 'lm_head.' for a T5 encoder")
    c.add_argument("--verbose", "-v", action="store_true", help="list every key left out")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from neuronbuild.toolchains.errors import ToolchainError
    from neuronbuild.toolchains.weights_convert import convert

    src, dest = Path(args.src), Path(args.dest)
    if not dest.name.endswith(".safetensors"):
        return bad_input(f"{dest}: the output must be a .safetensors file (a neuron_model's `weights` takes those)")
    if dest.exists() and not args.force:
        return bad_input(f"{dest} exists (pass --force to replace it)")
    try:
        report, dropped = convert(src, dest, allow_pickle=args.allow_pickle, prefix=args.prefix, drop=args.drop)
    except ToolchainError as e:
        return bad_input(str(e))
    print(report, file=streams.out())
    if args.verbose:
        for key in dropped:
            print(f"  left out: {key}", file=streams.out())
    return EXIT_OK
