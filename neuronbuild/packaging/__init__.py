"""Packaging phase: materialised outputs under neuronbuild-out/ (and, later, deployable bundles)."""
