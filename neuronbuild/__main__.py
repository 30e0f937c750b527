"""Entry point for `python -m neuronbuild`."""

from neuronbuild.cli import main

raise SystemExit(main())
