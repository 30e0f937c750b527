"""The shared vocabulary: Neuron platforms, CPU ISA levels, auto_cast values and input dtypes (names only)."""

from __future__ import annotations

CPU_PLATFORM = "cpu"
NEURON_PLATFORMS = ("inf2", "trn1", "trn2", "trn3")  # what neuronx-cc --target accepts
NEURON_INSTANCE_FAMILIES = (*NEURON_PLATFORMS, "inf1")  # what a Neuron host may report (DMI product name's family)
X86_LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")  # oldest first
CPU_ISAS = ("native", *X86_LEVELS)  # what a cpu neuron_target's `isa` may say ("native": this machine's level)
AUTO_CAST = ("none", "matmult", "all")
OPT_LEVELS = (1, 2, 3)
# Input dtypes a model may declare (torch.<name>); toolchains map them to their own types.
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
          "float8_e4m3fn")  # (an hf_causal_lm's fp8 KV cache: kv_cache_dtype, docs/quantization.md)
