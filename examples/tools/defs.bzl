"""Workspace-local macros: load("//tools:defs.bzl", "llama_model")."""

def llama_model(name, config, weights = None):
    """A neuron_model for the example decoder in //models:llama.py."""
    neuron_model(
        name = name,
        srcs = ["llama.py"],
        entry = "llama:build_model",
        config = config,
        inputs = {"input_ids": "int64[batch, seq]"},
        weights = weights,
    )
