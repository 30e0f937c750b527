"""Local memory: the machine's RAM, the --local-ram cap, per-action memory estimates and the budget that admits actions."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Share of the machine's RAM the build may plan for by default (Bazel's HOST_RAM*.67).
DEFAULT_SHARE = 0.67
# Peak resident memory (MB) of an action in a warm worker when none was recorded yet: measured on the example
# (trace ~0.5 GB incl. torch; AOTInductor compile 0.4-0.55 GB plus g++; Neuron CPU-compile path ~0.5 GB), rounded up.


def host_ram_mb() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20))
    except (ValueError, OSError):
        return 4096


def default_local_ram_mb() -> int:
    return max(1, int(host_ram_mb() * DEFAULT_SHARE))


_RAM = re.compile(r"^(?:(?P<num>\d+(?:\.\d+)?)(?P<unit>[kmgt]?)b?|host_ram\*(?P<share>\d*\.?\d+))$", re.I)


def parse_local_ram(text: str) -> int:
    """'4096' (MB), '16G', '512M', or 'HOST_RAM*.5' -> megabytes. Raises ValueError on anything else."""
    m = _RAM.match(text.strip().replace(" ", ""))
    if not m:
        raise ValueError(f"--local-ram: expected megabytes, a size like 16G, or HOST_RAM*0.5, got {text!r}")
    if m.group("share") is not None:
        mb = host_ram_mb() * float(m.group("share"))
    else:
        scale = {"": 1, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}[m.group("unit").lower()]
        mb = float(m.group("num")) * scale
    if mb < 1:
        raise ValueError(f"--local-ram must be at least 1 MB, got {text!r}")
    return int(mb)


@dataclass(frozen=True)
class RamBudget:
    """Admits an action only if the running actions' estimates plus its own fit the cap (one always runs)."""

    cap_mb: int

    def admits(self, running_mb: float, action_mb: float, running: int) -> bool:
        return running == 0 or running_mb + action_mb <= self.cap_mb


def rss_kib(pid: int | str = "self") -> int:
    """The resident set of a process (this one by default) in KiB, 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0
