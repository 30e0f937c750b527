"""Arguments shared by several commands."""

from __future__ import annotations

import argparse


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", help="cache directory (default: $NEURONBUILD_CACHE_DIR or ~/.cache/neuronbuild)")
