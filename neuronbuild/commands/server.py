"""`neuronbuild shutdown` and `neuronbuild info`: stop and describe this workspace's build server (docs/server.md)."""

from __future__ import annotations

import argparse
import json
import os

from neuronbuild import streams
from neuronbuild.errors import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("shutdown", help="stop this workspace's build server (the next command starts a new one)")
    s.add_argument("--output", choices=("text", "json"), default="text", help=argparse.SUPPRESS)
    i = sub.add_parser("info", help="the build server of this workspace: pid, memory (RSS), warm workers, log")
    i.add_argument("--output", choices=("text", "json"), default="text", help="output format (default text)")


def _paths(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from neuronbuild import command
    from neuronbuild.server import protocol
    from neuronbuild.server.client import startup_options
    from neuronbuild.workspace import find_workspace

    ws = find_workspace(command.current().cwd)  # outside a workspace: the usual one-line error, exit 2
    opts = startup_options(getattr(args, "output_user_root", None), getattr(args, "max_idle_secs", None))
    return protocol.server_paths(ws.root, opts.output_user_root)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.server.client import read_info_file, request, wait_gone

    paths = _paths(args)
    if args.command == "shutdown":
        ans = request(paths, {"type": "shutdown", "pid": os.getpid()}, timeout=None)
        if ans is None:
            print("neuronbuild: no build server is running for this workspace", file=streams.err())
            return EXIT_OK
        pid = ans.get("pid")
        if isinstance(pid, int):
            wait_gone(pid)
        print(f"neuronbuild: build server {pid} stopped", file=streams.err())
        return EXIT_OK
    ans = request(paths, {"type": "info"})
    if args.output == "json":
        print(json.dumps({"running": ans is not None, "output_base": str(paths.output_base),
                          **({k: v for k, v in ans.items() if k != "t"} if ans else {})}, indent=1, sort_keys=True), file=streams.out())
        return EXIT_OK
    print(f"output base: {paths.output_base}", file=streams.out())
    if ans is None:
        stale = read_info_file(paths)
        print("server: not running" + (f" (last pid {stale.get('pid')})" if stale else ""), file=streams.out())
        return EXIT_OK
    print(f"server: pid {ans['pid']}, up {ans['uptime_s']:.0f} s, {ans['commands']} commands"
          f"{', running one now' if ans.get('busy') else ''}", file=streams.out())
    print(f"server RSS: {ans['rss_kib'] / 1024:.0f} MiB; warm workers: {ans['workers']} "
          f"({ans['workers_rss_kib'] / 1024:.0f} MiB RSS together)", file=streams.out())
    print(f"idle timeout: {ans['max_idle_secs']} s (warm workers: {ans.get('workers_idle_secs', 300):g} s)", file=streams.out())
    print(f"socket: {ans['socket']}", file=streams.out())
    print(f"log: {ans['log']}", file=streams.out())
    return EXIT_OK
