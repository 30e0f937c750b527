"""`neuronbuild report [INVOCATION|last] [--compare OTHER] [--output html|json]`: a recorded build or plan as one
self-contained HTML page (its path is printed), or the same data as JSON."""

from __future__ import annotations

import argparse

from neuronbuild import streams
from neuronbuild.commands.common import bad_input


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="a recorded build or plan as an HTML page (summary, matrix, timeline, compare)")
    p.add_argument("invocation", nargs="?", default="last",
                   help="an invocation id (or a unique prefix), `last` (default) or `last~N`")
    p.add_argument("--compare", metavar="OTHER",
                   help="compare with this invocation (default: the previous one of the same patterns)")
    p.add_argument("--output", choices=("html", "json"), default="html",
                   help="html: write the page and print its path (default); json: print the page's data")
    p.add_argument("--list", action="store_true", help="list the recorded invocations of this workspace")


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from neuronbuild import command
    from neuronbuild.errors import EXIT_OK
    from neuronbuild.report.invocation import page_inputs, page_url, render_invocation
    from neuronbuild.report.store import InvocationStore, output_base
    from neuronbuild.workspace import find_workspace

    store = InvocationStore(output_base(find_workspace(command.current().cwd).root, getattr(args, "output_user_root", None)))
    if args.list:
        for e in store.index():
            c = e.get("counts") or {}
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e.get("started") or 0)))
            print(f"{e.get('id')}  {when}  {e.get('command')} {' '.join(e.get('patterns') or ())}  "
                  f"{e.get('outcome')}  {e.get('total') or 0} actions, {c.get('executed', 0)} executed"
                  + ("  (no-op)" if e.get("noop") else ""), file=streams.out())
        return EXIT_OK
    inv_id = store.resolve(args.invocation)
    rec = store.load(inv_id) if inv_id else None
    if rec is None:
        known = store.ids()
        hint = f" (recorded: {known[0]} .. {known[-1]}; `neuronbuild report --list`)" if known else \
            " (no invocation of this workspace is recorded yet: run a build)"
        return bad_input(f"no recorded invocation {args.invocation!r}{hint}")
    try:
        if args.output == "json":
            from neuronbuild.report.view import page_context

            full, other, history = page_inputs(store, rec, args.compare)
            ctx = page_context(full, other, history)
            print(json.dumps({k: ctx[k] for k in ("rec", "summary", "matrix", "failures", "timeline", "compare",
                                                  "trends")}, indent=1, default=str), file=streams.out())
            return EXIT_OK
        page = render_invocation(store, rec, args.compare)
    except LookupError as e:
        return bad_input(str(e.args[0]))
    print(page_url(page), file=streams.out())
    return EXIT_OK
