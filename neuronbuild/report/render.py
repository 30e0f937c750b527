"""Rendering an invocation page: one self-contained HTML file (jinja2; inline CSS, SVG and a little plain JS; no
network), written beside the invocation's record. The template is compiled once per process (a build server keeps it)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronbuild.atomic import atomic_write_bytes

_TEMPLATE: Any = None


def _template() -> Any:
    global _TEMPLATE
    if _TEMPLATE is None:
        import jinja2

        env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
        src = (Path(__file__).parent / "page.html.j2").read_text(encoding="utf-8")
        _TEMPLATE = env.from_string(src)
    return _TEMPLATE


def render(rec: Mapping[str, Any], other: Mapping[str, Any] | None, history: Sequence[Mapping[str, Any]]) -> str:
    from neuronbuild.report.view import page_context

    ctx = page_context(rec, other, history)
    ctx["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(rec.get("started") or 0)))
    return str(_template().render(**ctx))


def write_page(dest: Path, html: str) -> Path:
    atomic_write_bytes(dest, html.encode("utf-8"), dest.parent, durable=False)
    return dest
