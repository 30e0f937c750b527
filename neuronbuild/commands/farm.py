"""`neuronbuild farm status --scheduler ADDR`: the compile farm's workers, their toolchains and their load."""

from __future__ import annotations

import argparse
from typing import Any

from neuronbuild import streams
from neuronbuild.errors import EXIT_BUILD_FAILED, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    f = sub.add_parser("farm", help="inspect a Dask compile farm")
    fs = f.add_subparsers(dest="farm_command", required=True)
    s = fs.add_parser("status", help="list workers with their toolchains (python, torch, cxx, neuronx-cc) and load")
    s.add_argument("--scheduler", required=True, metavar="tcp://HOST:PORT", help="the Dask scheduler")
    s.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the scheduler (default 30)")


def run(args: argparse.Namespace) -> int:
    try:
        from distributed import Client
    except ImportError:
        print("neuronbuild: error: the farm commands need dask[distributed]: pip install 'neuronbuild[farm]'",
              file=streams.err())
        return EXIT_BUILD_FAILED
    from neuronbuild.execution.dask_executor import worker_toolchain

    try:
        client = Client(args.scheduler, timeout=f"{args.timeout}s")
    except (OSError, TimeoutError) as e:
        print(f"neuronbuild: error: cannot reach the Dask scheduler at {args.scheduler}: {e}", file=streams.err())
        return EXIT_BUILD_FAILED
    with client:
        info = client.scheduler_info()
        workers = info.get("workers", {})
        toolchains = client.run(worker_toolchain, on_error="return") if workers else {}
        processing = client.processing()
    print(f"scheduler {args.scheduler}: {len(workers)} worker(s), "
          f"{sum(int(w.get('nthreads', 0)) for w in workers.values())} thread(s)", file=streams.out())
    # The toolchains' columns (Toolchain.host_status) as the workers report them, in the order first seen.
    columns: dict[str, None] = {}
    for tc in toolchains.values():
        if isinstance(tc, dict) and isinstance(tc.get("status"), dict):
            columns.update(dict.fromkeys(tc["status"]))
    header = ("worker", "host", "pid", "threads", "running", "memory", "python", "torch", *columns)
    rows = [header]
    for addr, w in sorted(workers.items()):
        tc = toolchains.get(addr)
        tc = tc if isinstance(tc, dict) else {"host": f"error: {tc}"}
        got = tc.get("status")
        status: dict[str, Any] = got if isinstance(got, dict) else {}
        mem = float((w.get("metrics") or {}).get("memory") or 0) / (1 << 20)
        rows.append((addr, str(tc.get("host", "?")), str(tc.get("pid", "?")), str(w.get("nthreads", "?")),
                     str(len(processing.get(addr, ()))), f"{mem:.0f} MiB", str(tc.get("python", "?")),
                     str(tc.get("torch", "?")),
                     *(str(status[c]) if status.get(c) is not None else "-" if c in status else "?" for c in columns)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)).rstrip(), file=streams.out())
    return EXIT_OK
