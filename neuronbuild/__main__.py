"""Entry point for `python -m neuronbuild`."""

from neuronbuild.cli import entry

entry()
