"""Rendering an invocation page: one self-contained HTML file (jinja2; inline CSS, SVG and a little plain JS; no
network), written beside the invocation's record. The template is compiled once per process (a build server keeps it).

The parts that grow with the build, the matrix (rows x compile targets, a run of empty cells as one cell), one table row
and one details block per action, and the trend plots are written here in plain Python (`matrix_html`,
`actions_html`, `trends_html`): through the template they took ~90% of the render of a 2,624-action page. A no-op's page is its base's no-op page with its own id, time, command line and trends put in
(`noop_skeleton`, `from_skeleton`: see report/invocation.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from neuronbuild.atomic import atomic_write_bytes

_TEMPLATE: Any = None
TRUNCATE_AT = 300  # characters of a record field's value shown on the page


def _template() -> Any:
    global _TEMPLATE
    if _TEMPLATE is None:
        import jinja2

        env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
        src = (Path(__file__).parent / "page.html.j2").read_text(encoding="utf-8")
        _TEMPLATE = env.from_string(src)
    return _TEMPLATE


def _e(v: Any) -> str:
    return escape(v if isinstance(v, str) else str(v))


def truncate(s: str, length: int = TRUNCATE_AT, leeway: int = 5) -> str:
    """As jinja2's `truncate` filter: whole words, "..." appended, a few characters over the length kept."""
    if len(s) <= length + leeway:
        return s
    return s[:length - 3].rsplit(" ", 1)[0] + "..."


def actions_html(details: Sequence[Mapping[str, Any]]) -> str:
    """The actions section: a sortable table (one row per action) and each action's details block."""
    out = [f'<section id="actions">\n<h2>Actions ({len(details)})</h2>\n<table id="actions-table">\n'
           '<thead><tr><th class="sortable" data-col="0">action</th><th class="sortable" data-col="1">state</th>'
           '<th class="sortable" data-col="2">seconds</th><th class="sortable" data-col="3">CPU s</th>'
           '<th class="sortable" data-col="4">peak MB</th><th>worker</th></tr></thead>\n<tbody>\n']
    add = out.append
    for a in details:
        peak = f"{float(a['peak_rss_mb']):.0f}" if a.get("peak_rss_mb") else ""
        add(f'<tr class="st-{_e(a["state"])}"><td><a href="#{_e(a["anchor"])}">{_e(a["description"])}</a></td>'
            f'<td>{_e(a["text"])}</td><td class="num">{"" if a.get("seconds") is None else _e(a["seconds"])}</td>'
            f'<td class="num">{_e(a.get("cpu_s") or "")}</td><td class="num">{peak}</td>'
            f'<td class="mono">{_e(a.get("worker") or "")}</td></tr>\n')
    add("</tbody>\n</table>\n")
    for a in details:
        state = _e(a["state"])
        fp = str(a["fingerprint"])
        add(f'<details class="action" id="{_e(a["anchor"])}"{" open" if a["state"] == "failed" else ""}>\n'
            f'<summary><span class="st-{state}">{_e(a["text"])}</span> {_e(a["description"])} '
            f'<span class="mono">{_e(fp[:12])}</span></summary>\n<p class="mono">fingerprint {_e(fp)}')
        if a.get("seconds"):
            add(f" &middot; {_e(a['seconds'])} s")
        if a.get("cpu_s"):
            add(f" &middot; {_e(a['cpu_s'])} CPU s")
        if a.get("peak_rss_mb"):
            add(f" &middot; peak {float(a['peak_rss_mb']):.0f} MB")
            if a.get("estimate_mb"):
                add(f" (admitted at an estimated {float(a['estimate_mb']):.0f} MB)")
        if a.get("worker"):
            add(f" &middot; {_e(a['worker'])}")
        if a.get("estimate_s"):
            add(f" &middot; estimated {_e(a['estimate_s'])} s")
        add("</p>\n")
        if a.get("error"):
            add(f'<div class="err">{_e(a["error"])}</div><p class="mono">log: {_e(a.get("log", ""))}</p>')
            if a.get("log_excerpt"):
                add(f"<pre>{_e(a['log_excerpt'])}</pre>")
            add("\n")
        if a.get("outputs"):
            add("<table><tr><th>output</th><th>digest</th></tr>")
            add("".join(f'<tr><td class="mono">{_e(n)}</td><td class="mono">{_e(d)}</td></tr>'
                        for n, d in a["outputs"].items()))
            add("</table>\n")
        if a.get("record_rows"):
            add('<table class="record"><tr><th>record field</th><th>value</th></tr>')
            add("".join(f'<tr><td class="mono">{_e(k)}</td><td class="mono">{_e(truncate(v))}</td></tr>'
                        for k, v in a["record_rows"]))
            add("</table>\n")
        add("</details>\n")
    add("</section>")
    return "".join(out)


def matrix_html(matrix: Mapping[str, Any]) -> str:
    """The matrix table (view.matrix): one row per (model, graph, bucket), one column per compile target; a run of
    empty cells is one cell spanning them (at 1,000 graphs most of the rows x columns are empty)."""
    cols = matrix["columns"]
    out = ['<table id="matrix-table">\n<thead><tr><th>model</th><th>graph</th><th>bucket</th>',
           *(f'<th>{_e(c["label"])}<br><span class="mono">{_e(c["target"])}</span></th>' for c in cols),
           "</tr></thead>\n<tbody>\n"]
    add = out.append
    for r in matrix["rows"]:
        bucket = _e(r["bucket"])
        add(f'<tr class="mrow">\n<td class="mono">{_e(r["model"])}</td><td>{_e(r["graph"])}</td>'
            f'<td class="mono">{bucket}</td>\n')
        row_attrs = f'data-bucket="{bucket}" data-name="{_e(r["name"])}" data-model="{_e(r["model"])}" ' \
                    f'data-graph="{_e(r["graph"])}"'
        cells = r["cells"]
        empty = 0
        for i in range(len(cols)):
            cell = cells.get(i)
            if cell is None:
                empty += 1
                continue
            if empty:
                add(f'<td class="empty" colspan="{empty}"></td>' if empty > 1 else '<td class="empty"></td>')
                empty = 0
            state = _e(cell["state"])
            add(f'<td class="cell st-{state}" data-state="{state}" data-target="{_e(cols[i]["label"])}" {row_attrs} '
                f'title="{_e(cell["primary"])}"><a href="#{_e(cell["anchor"])}">{_e(cell["text"])}')
            if cell.get("seconds"):
                add(f" &middot; {_e(cell['seconds'])} s")
            if cell.get("peak_mb"):
                add(f" &middot; {float(cell['peak_mb']):.0f} MB")
            add("</a>")
            if cell.get("error"):
                add(f'<div class="err">{_e(cell["error"])}</div>')
            add("</td>")
        if empty:
            add(f'<td class="empty" colspan="{empty}"></td>' if empty > 1 else '<td class="empty"></td>')
        add("\n</tr>")
    if not matrix["rows"]:
        add('<tr><td colspan="3">no compile targets in this invocation</td></tr>')
    add("\n</tbody>\n</table>")
    return "".join(out)


def trends_html(trends: Sequence[Mapping[str, Any]], current: str) -> str:
    """The trend plots (view.trends), the current invocation's dot marked."""
    if not trends:
        return ""
    out = [f'<section id="trends">\n<h2>Trends (last {_e(trends[0]["n"])} builds of this workspace)</h2>\n'
           '<div class="trends">\n']
    for t in trends:
        dots = "".join(
            f'<circle cx="{_e(d["x"])}" cy="{_e(d["y"])}" r="{4 if d["id"] == current else 2}" '
            f'fill="{"#d1242f" if d["id"] == current else "#2f6fbf"}"><title>{_e(d["id"])}: {_e(d["v"])} '
            f'{_e(t["unit"])}</title></circle>' for d in t["dots"])
        out.append(f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{_e(t["w"])}" height="{_e(t["h"])}" '
                   f'role="img" aria-label="{_e(t["title"])}"><rect x="0" y="0" width="{_e(t["w"])}" '
                   f'height="{_e(t["h"])}" fill="#fafbfc" stroke="#dde1e6"/><polyline points="{_e(t["points"])}" '
                   f'fill="none" stroke="#2f6fbf" stroke-width="1.5"/>{dots}</svg>\n'
                   f'<figcaption>{_e(t["title"])}: {_e(t["last"])} {_e(t["unit"])} (max {_e(t["max"])})'
                   '</figcaption></figure>')
    out.append("\n</div>\n</section>")
    return "".join(out)


def _started(rec: Mapping[str, Any]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(rec.get("started") or 0)))


def render(rec: Mapping[str, Any], other: Mapping[str, Any] | None, history: Sequence[Mapping[str, Any]]) -> str:
    from markupsafe import Markup

    from neuronbuild.report.view import page_context

    ctx = page_context(rec, other, history)
    ctx["started"] = _started(rec)
    ctx["actions_html"] = Markup(actions_html(ctx["details"]))
    ctx["matrix_html"] = Markup(matrix_html(ctx["matrix"]))
    ctx["trends_html"] = Markup(trends_html(ctx["trends"], str(rec.get("id"))))
    return str(_template().render(**ctx))


# What differs between two no-op pages of one base, marked in its skeleton (NUL: never in a rendered value).
_SLOTS = ("id", "started", "argv", "total", "trends")


def _slot(name: str) -> str:
    return f"\x00nb-{name}\x00"


def noop_skeleton(noop_view: Mapping[str, Any]) -> str | None:
    """The page of a no-op standing for a base (`noop_view`: view.with_base of a no-op record and that base), its
    per-invocation values left as slots for `from_skeleton`, after a first line naming the code that made it."""
    from markupsafe import Markup

    from neuronbuild.report.view import page_context

    rec = {**noop_view, "id": _slot("id"), "argv": [_slot("argv")], "total": _slot("total")}
    ctx = page_context(rec, None, [])
    ctx["started"] = _slot("started")
    ctx["actions_html"] = Markup(actions_html(ctx["details"]))
    ctx["matrix_html"] = Markup(matrix_html(ctx["matrix"]))
    ctx["trends_html"] = Markup(_slot("trends"))
    html = str(_template().render(**ctx))
    if any(p.removeprefix("nb-") not in _SLOTS for p in html.split("\x00")[1::2]):
        return None  # a NUL in a recorded value: such a base's no-ops get their pages rendered in full
    return f"{code_digest()}\n{html}"


def code_digest() -> str:
    """What a skeleton was made by: the template and the code that fills it (a skeleton by other code is not used)."""
    import hashlib

    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("page.html.j2", "render.py", "view.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:24]


def from_skeleton(skeleton: str, rec: Mapping[str, Any], history: Sequence[Mapping[str, Any]]) -> str | None:
    """A no-op's page from its base's no-op skeleton: no jinja2, no action rendered again; None if the skeleton was
    made by other code."""
    from neuronbuild.report.view import trends

    made_by, _nl, skeleton = skeleton.partition("\n")
    if made_by != code_digest():
        return None

    values = {"id": _e(rec["id"]), "started": _e(_started(rec)), "argv": _e(" ".join(map(str, rec.get("argv") or ()))),
              "total": _e(rec.get("total") or 0), "trends": trends_html(trends(history, str(rec["id"])),
                                                                           str(rec["id"]))}
    parts = skeleton.split("\x00")
    for i in range(1, len(parts), 2):  # (odd parts: slot names)
        name = parts[i].removeprefix("nb-")
        parts[i] = values[name] if name in values else ""
    return "".join(parts)


def write_page(dest: Path, html: str) -> Path:
    atomic_write_bytes(dest, html.encode("utf-8"), dest.parent, durable=False)
    return dest
