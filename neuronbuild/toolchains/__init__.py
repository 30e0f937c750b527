"""Torch-facing toolchains: model import, export tracing, FX passes, AOTInductor/Neuron compiles, compiler flags."""
