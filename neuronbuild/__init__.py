"""neuronbuild: a declarative, Bazel-style build system for compiling model graphs (package root; imports nothing heavy)."""

__version__ = "0.1.0"
# Bumped whenever the meaning of a fingerprint record or a cached output changes.
FORMAT_VERSION = "nb2"  # nb2: cpu packages without constants + constants.safetensors
