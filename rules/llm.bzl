"""Macros for LLM-style models shipped with neuronbuild: load("@neuronbuild//rules:llm.bzl", "llm_buckets", "llm_compile")."""

def llm_buckets(name, batch_sizes, context_lengths, decode = True, tags = []):
    """Context-encoding buckets (every batch size x context length) plus, with decode, one token-generation bucket
    (seq = 1) per batch size."""
    if not batch_sizes or not context_lengths:
        fail("llm_buckets: batch_sizes and context_lengths must be non-empty")
    shapes = [{"batch": b, "seq": s} for b in batch_sizes for s in context_lengths]
    if decode:
        shapes = shapes + [{"batch": b, "seq": 1} for b in batch_sizes if 1 not in context_lengths]
    neuron_buckets(name = name, shapes = shapes, tags = tags)

def llm_compile(name, model, buckets, targets, options = None, tags = []):
    """One neuron_compile per target, named <name>_<target name> (e.g. llama_trn2, llama_cpu)."""
    if not targets:
        fail("llm_compile: targets must be non-empty")
    for t in targets:
        short = t.split(":")[-1] if ":" in t else t.split("/")[-1]
        neuron_compile(
            name = "%s_%s" % (name, short),
            model = model,
            buckets = buckets,
            target = t,
            options = options,
            tags = tags,
        )
