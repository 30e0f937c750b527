"""What this host offers (torch version, CPU ISA level, Neuron platform and NeuronCores) and whether a built graph can
run on it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from neuronbuild.platforms import host_isa  # stdlib-only module (no build-side dependencies)
from neuronbuild.plugin_api.loader import Host, Mismatch
from neuronbuild.runtime import loaders
from neuronbuild.runtime.layout import Graph
from neuronbuild.vocabulary import NEURON_INSTANCE_FAMILIES

NEURON_PLATFORM_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"


def torch_version() -> str:
    """The installed torch version from package metadata (does not import torch)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not-installed"


def neuron_platform(libnrt: str | None = None) -> str | None:
    """NEURON_PLATFORM_TARGET_OVERRIDE, else the instance family libnrt reports (`libnrt`: what nrt_get_instance_info
    said), else the one a host with /dev/neuron* reports (DMI product name), else None."""
    forced = os.environ.get(NEURON_PLATFORM_ENV, "").strip()
    if forced:
        return forced
    if libnrt in NEURON_INSTANCE_FAMILIES:
        return libnrt
    if not any(Path("/dev").glob("neuron[0-9]*")):
        return None
    try:
        product = Path("/sys/devices/virtual/dmi/id/product_name").read_text().strip()
    except OSError:
        return None
    family = product.split(".", 1)[0]
    return family if family in NEURON_INSTANCE_FAMILIES else None


def current_host() -> Host:
    """This host; its Neuron platform and NeuronCores from libnrt when one is installed ($NEURONBUILD_LIBNRT, else
    /opt/aws/neuron/lib/libnrt.so), asked without initialising it."""
    from neuronbuild.runtime.libnrt import host_info

    try:
        nrt = host_info()
    except RuntimeError:  # a libnrt that fails to answer: as if there were none
        nrt = None
    return Host(torch_version(), host_isa(), neuron_platform(nrt.family if nrt else None),
                nrt.cores if nrt else None)


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def check_graph(g: Graph, host: Host, emulate: str | None = None) -> list[Mismatch]:
    """Every reason `g` cannot run on `host` (empty when it can): the torch version, then what the runtime loader
    of its artifact format checks (e.g. the ISA level of a cpu package, the Neuron platform of a Neuron graph)."""
    out: list[Mismatch] = []
    built_torch = str(g.toolchain.get("torch", ""))
    if _public(built_torch) != _public(host.torch):
        out.append(Mismatch(g.describe(), "toolchain.torch", built_torch, host.torch))
    loader = loaders.loader_for(g.format)
    if loader is None:
        out.append(Mismatch(g.describe(), "format", g.format, no_loader(g.format)))
    else:
        out.extend(loader.host_mismatches(g, host, emulate))
    return out


def no_loader(fmt: str) -> str:
    """Why a graph of format `fmt` cannot be loaded here: no registered runtime loader (and which plug-in modules
    could not be imported)."""
    skipped = loaders.loader_problems()
    return (f"no runtime loader for artifact format {fmt!r} (its toolchain's `runtime_loader` module must be "
            f"importable here: a built-in, or named in $NEURONBUILD_PLUGINS)"
            + (f"; could not import {', '.join(skipped)}" if skipped else ""))


def unrunnable(graphs: Iterable[Graph], host: Host) -> tuple[int, list[str]]:
    """How many of `graphs` cannot run on `host`, and one line per label saying how many of its graphs and why
    (each distinct reason once)."""
    count = 0
    by_label: dict[str, tuple[list[int], dict[str, None]]] = {}
    for g in graphs:
        n, reasons = by_label.setdefault(g.label, ([0, 0], {}))
        n[1] += 1
        found = check_graph(g, host)
        if found:
            count += 1
            n[0] += 1
            for m in found:
                reasons.setdefault(f"{m.field} differs (built for {m.built}, this host has {m.here})", None)
    lines = [f"{label}: {n[0]} of {n[1]} graph(s): {'; '.join(reasons)}"
             for label, (n, reasons) in by_label.items() if n[0]]
    return count, lines
