"""From invocation records to what the page shows: summary, failures, the model x graph x bucket x target matrix,
action details, the per-worker timeline with its critical path, the compare view (explain's field diff) and trends."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from neuronbuild.report import states as R

STATE_TEXT = {R.FAILED: "failed", R.SKIPPED: "not run (an input failed)", R.STOPPED: "stopped",
              R.NOT_STARTED: "not started", R.TO_BUILD: "to build", R.EXECUTED: "executed", R.CUTOFF: "early cutoff",
              R.CACHED_SHARED: "cached (shared)", R.CACHED_LOCAL: "cached (local)", R.CACHED: "cached",
              R.NOT_NEEDED: "not needed"}
_RANK = {s: i for i, s in enumerate(R.STATES)}


def anchor(fp: str) -> str:
    return f"a-{fp[:16]}"


def with_base(rec: Mapping[str, Any], base: Mapping[str, Any] | None) -> dict[str, Any]:
    """A no-op answered by the fast path records no actions: it stands for its base's (the last full build of the
    same request), every one of them cached locally."""
    out = dict(rec)
    if rec.get("noop") and base is not None and not rec.get("actions"):
        acts = []
        for a in base.get("actions") or ():
            d = {k: v for k, v in a.items() if k not in ("duration_s", "cpu_s", "worker", "start", "end", "attempt")}
            d["state"] = R.CACHED_LOCAL if a.get("state") != R.NOT_NEEDED else R.NOT_NEEDED
            if a.get("duration_s") and "recorded_s" not in d:
                d["recorded_s"] = a["duration_s"]
            acts.append(d)
        out["actions"] = acts
        out["compiles"] = base.get("compiles") or []
        counts = {s: 0 for s in R.STATES}
        for d in acts:
            counts[d["state"]] += 1
        out["counts"] = counts
        out["saved_s"] = round(sum(float(d.get("recorded_s") or 0.0) for d in acts if d["state"] == R.CACHED_LOCAL), 3)
    return out


def _flatten(v: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(v, dict) and v:
        return [row for k in sorted(v, key=str) for row in _flatten(v[k], f"{path}.{k}" if path else str(k))]
    return [(path, v if isinstance(v, str) else json.dumps(v, sort_keys=True))]


def matrix(rec: Mapping[str, Any]) -> dict[str, Any]:
    """Rows (model, graph family, bucket) x columns (compile targets); a cell: the worst state of its actions."""
    by_fp = {a["fingerprint"]: a for a in rec.get("actions") or ()}
    cols: list[dict[str, Any]] = []
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for c in rec.get("compiles") or ():
        col = len(cols)
        cols.append({"label": c["label"], "platform": c["platform"], "target": c["target"]})
        for b in c["buckets"]:
            key = (c["model"], b["graph"], b["bucket"])
            shape = ", ".join(f"{k}={v}" for k, v in (b["dims"] or {}).items())  # (the graph has its column)
            row = rows.setdefault(key, {"model": c["model"], "graph": b["graph"] or "-", "bucket": shape,
                                        "name": b.get("name", ""), "dims": b["dims"], "cells": {}})
            acts = [by_fp[fp] for fp in b["actions"] if fp in by_fp]
            states = [a["state"] for a in acts] or [R.NOT_NEEDED]
            # a cached compile does not need its trace: "not needed" never decides a cell with other states
            decisive = [s for s in states if s != R.NOT_NEEDED] or states
            state = min(decisive, key=lambda s: _RANK[s])
            primary = by_fp.get(b["primary"], {})
            secs = sum(float(a.get("duration_s") or 0.0) for a in acts if a["state"] in (R.EXECUTED, R.FAILED))
            err = next((a.get("error", "") for a in acts if a["state"] == R.FAILED), "")
            text = STATE_TEXT[state]
            skipped = by_fp.get(b["primary"], {}).get("skipped_step")
            if state == R.EXECUTED and skipped:  # its compile ran but left the real work out: say so in the cell
                text = f"{text}, compile skipped ({skipped})"
            row["cells"][col] = {"state": state, "text": text, "anchor": anchor(b["primary"]),
                                 "seconds": round(secs, 1), "peak_mb": max((float(a.get("peak_rss_mb") or 0.0)
                                                                           for a in acts if a["state"] == R.EXECUTED),
                                                                          default=0.0),
                                 "error": (err.splitlines() or [""])[0][:200],
                                 "actions": [{"anchor": anchor(a["fingerprint"]), "kind": a["kind"],
                                              "state": a["state"]} for a in acts],
                                 "primary": primary.get("description", "")}
    ordered = sorted(rows.values(), key=lambda r: (r["model"], r["graph"], sorted(r["dims"].items())))
    return {"columns": cols, "rows": ordered}


def critical_path(rec: Mapping[str, Any]) -> list[str]:
    """The chain that decided the wall time: from the action that ended last, back through the input that ended
    last before it started (among the actions that ran in this build)."""
    ran = {a["fingerprint"]: a for a in rec.get("actions") or () if a.get("end") and a.get("start")}
    if not ran:
        return []
    cur = max(ran.values(), key=lambda a: float(a["end"]))
    path = [cur["fingerprint"]]
    while True:
        deps = [ran[d] for d in cur.get("deps") or () if d in ran]
        if not deps:
            break
        cur = max(deps, key=lambda a: float(a["end"]))
        path.append(cur["fingerprint"])
    return list(reversed(path))


def timeline(rec: Mapping[str, Any], width: int = 960, lane: int = 22) -> dict[str, Any]:
    """Lanes (one per worker) of slices placed in SVG coordinates; critical-path slices marked."""
    slices = list(rec.get("slices") or ())
    if not slices:
        return {"lanes": [], "width": width, "height": 0, "ticks": []}
    # The axis is the build's wall time (the summary's: from the cache check to the scheduler's end), so the two agree;
    # a warm-up begun before the cache check widens it to the left.
    first = min(float(s["start"]) for s in slices)
    t0 = min(float(rec.get("t0") or first), first)
    t1 = max(max(float(s["end"]) for s in slices), t0 + float(rec.get("wall_s") or 0.0))
    span = max(t1 - t0, 1e-3)
    label_w = 150
    scale = (width - label_w - 10) / span
    crit = set(critical_path(rec))
    workers = sorted({str(s["worker"]) for s in slices}, key=lambda w: (w.startswith("zygote"), len(w), w))
    lanes = []
    for i, w in enumerate(workers):
        y = 20 + i * lane
        items = []
        for s in slices:
            if str(s["worker"]) != w:
                continue
            x = label_w + (float(s["start"]) - t0) * scale
            fp = str(s.get("fingerprint") or "")
            items.append({"x": round(x, 1), "w": round(max(1.5, (float(s["end"]) - float(s["start"])) * scale), 1),
                          "y": y, "h": lane - 6, "name": s["name"],
                          "secs": round(float(s["end"]) - float(s["start"]), 2),
                          "cls": "warm" if s.get("kind") == "warm_up" else ("ok" if s.get("ok") else "bad"),
                          "crit": fp in crit and bool(s.get("ok")), "anchor": anchor(fp) if fp else ""})
        lanes.append({"worker": w, "y": y, "slices": items})
    step = _tick_step(span)
    ticks = [{"x": round(label_w + t * scale, 1), "text": f"{t:g} s"} for t in _frange(0.0, span, step)]
    return {"lanes": lanes, "width": width, "height": 30 + len(workers) * lane, "ticks": ticks,
            "critical": [a for a in crit], "span": round(span, 2)}


def _tick_step(span: float) -> float:
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600):
        if span / step <= 10:
            return float(step)
    return 7200.0


def _frange(a: float, b: float, step: float) -> list[float]:
    out = []
    t = a
    while t <= b + 1e-9:
        out.append(round(t, 3))
        t += step
    return out


def _group(a: Mapping[str, Any]) -> tuple[str, str, str, str, tuple[str, ...]]:
    return (a["kind"], a["label"], a.get("platform") or "", a.get("graph") or "", tuple(sorted(a.get("dims") or {})))


def compare(new: Mapping[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    """Which actions changed between two invocations (by identity: a new fingerprint, or a new identity compared
    with the closest bucket no longer built), which fields of their records, and how their time moved."""
    from neuronbuild.analysis.explain import ABSENT, caused_changes, describe_change

    old_acts = list(old.get("actions") or ())
    new_acts = list(new.get("actions") or ())
    old_id = {a["identity"]: a for a in old_acts}
    new_id = {a["identity"]: a for a in new_acts}
    old_fp = {a["fingerprint"]: a for a in old_acts}
    new_fp = {a["fingerprint"]: a for a in new_acts}
    gone = [a for i, a in old_id.items() if i not in new_id]
    changed = []
    for a in new_acts:
        prev = old_id.get(a["identity"])
        note = ""
        if prev is None:
            mine = a.get("dims") or {}
            sibs = [o for o in gone if _group(o) == _group(a)]
            if sibs:
                prev = min(sibs, key=lambda o: sum(1 for k in mine if (o.get("dims") or {}).get(k) != mine[k]))
                note = f"new bucket; compared with [{prev['bucket']}], no longer built"
        elif prev["fingerprint"] == a["fingerprint"]:
            continue
        if prev is None:
            changed.append({"description": a["description"], "anchor": anchor(a["fingerprint"]),
                            "note": "no previous result for this action identity", "fields": [],
                            "state": a["state"], "old_s": None, "new_s": _secs(a)})
            continue
        fields = []
        if prev.get("record") is not None and a.get("record") is not None:
            for p, o, n in caused_changes(prev["record"], a["record"], lambda fp: old_fp.get(fp, {}).get("record"),
                                          lambda fp: new_fp.get(fp, {}).get("record")):
                fields.append({"field": ".".join(p), "text": describe_change(p, o, n, a["record"]),
                               "old": None if o is ABSENT else o, "new": None if n is ABSENT else n})
        changed.append({"description": a["description"], "anchor": anchor(a["fingerprint"]), "note": note,
                        "fields": fields, "state": a["state"], "old_s": _secs(prev), "new_s": _secs(a),
                        "old_fp": prev["fingerprint"][:12], "new_fp": a["fingerprint"][:12]})
    paired = {c["note"].split("[", 1)[1].split("]", 1)[0] for c in changed if c["note"].startswith("new bucket")}
    removed = [{"description": a["description"]} for a in gone if a["bucket"] not in paired]
    return {"other": old["id"], "other_started": old.get("started"), "changed": changed, "removed": removed,
            "wall": [old.get("wall_s", 0.0), new.get("wall_s", 0.0)],
            "executed": [(old.get("counts") or {}).get(R.EXECUTED, 0), (new.get("counts") or {}).get(R.EXECUTED, 0)]}


def _secs(a: Mapping[str, Any]) -> float | None:
    v = a.get("duration_s") or a.get("recorded_s")
    return round(float(v), 2) if v else None


def hit_rate(rec: Mapping[str, Any]) -> float:
    c = rec.get("counts") or {}
    cached = sum(int(c.get(s, 0)) for s in (R.CACHED_LOCAL, R.CACHED_SHARED, R.CUTOFF, R.CACHED))
    run = cached + sum(int(c.get(s, 0)) for s in (R.EXECUTED, R.FAILED, R.TO_BUILD))
    return cached / run if run else 1.0


def trends(history: Sequence[Mapping[str, Any]], current: str, w: int = 300, h: int = 70) -> list[dict[str, Any]]:
    """Small line plots over the recorded builds: wall time, cache hit rate, time saved by the cache."""
    builds = [r for r in history if r.get("command") == "build"]
    out = []
    for key, title, unit in (("wall_s", "wall time", "s"), ("hit", "cache hit rate", "%"),
                             ("saved_s", "time saved by the cache", "s")):
        vals = [hit_rate(r) * 100 if key == "hit" else float(r.get(key) or 0.0) for r in builds]
        if not vals:
            continue
        top = max(vals) or 1.0
        n = len(vals)
        pts = [(round(10 + (i * (w - 20) / max(1, n - 1)), 1), round(h - 10 - v / top * (h - 20), 1))
               for i, v in enumerate(vals)]
        cur = [p for p, r in zip(pts, builds, strict=True) if r.get("id") == current]
        out.append({"title": title, "unit": unit, "points": " ".join(f"{x},{y}" for x, y in pts),
                    "dots": [{"x": x, "y": y, "v": round(v, 1), "id": r.get("id")}
                             for (x, y), v, r in zip(pts, vals, builds, strict=True)],
                    "current": cur[0] if cur else None, "last": round(vals[-1], 1), "max": round(top, 1),
                    "w": w, "h": h, "n": n})
    return out


def _skipped_steps(rec: Mapping[str, Any]) -> dict[str, int]:
    """Executed actions whose step was skipped, by reason ({'no neuronx-cc': 4}): they made no artifact."""
    out: dict[str, int] = {}
    for a in rec.get("actions") or ():
        if a.get("skipped_step"):
            out[str(a["skipped_step"])] = out.get(str(a["skipped_step"]), 0) + 1
    return out


def page_context(rec: Mapping[str, Any], other: Mapping[str, Any] | None,
                 history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    acts = sorted(rec.get("actions") or (), key=lambda a: (_RANK[a["state"]], a["description"]))
    details = []
    for a in acts:
        text = STATE_TEXT[a["state"]]
        if a.get("skipped_step"):  # executed, but its real work was left out (a Neuron compile without neuronx-cc)
            text = f"{text}: step skipped ({a['skipped_step']})"
        details.append({**a, "anchor": anchor(a["fingerprint"]), "text": text,
                        "record_rows": _flatten(a["record"]) if a.get("record") is not None else [],
                        "seconds": _secs(a)})
    c = rec.get("counts") or {}
    grid = matrix(rec)
    summary = {
        "targets": [col["label"] for col in grid["columns"]],
        "executed": c.get(R.EXECUTED, 0), "cached_local": c.get(R.CACHED_LOCAL, 0),
        "cached_shared": c.get(R.CACHED_SHARED, 0), "cutoff": c.get(R.CUTOFF, 0), "failed": c.get(R.FAILED, 0),
        "skipped": c.get(R.SKIPPED, 0) + c.get(R.STOPPED, 0) + c.get(R.NOT_STARTED, 0),
        "to_build": c.get(R.TO_BUILD, 0), "cached": c.get(R.CACHED, 0), "not_needed": c.get(R.NOT_NEEDED, 0),
        "hit_rate": round(hit_rate(rec) * 100, 1),
        "skipped_steps": _skipped_steps(rec),
    }
    return {"rec": rec, "summary": summary, "matrix": grid, "details": details,
            "failures": [d for d in details if d["state"] == R.FAILED], "timeline": timeline(rec),
            "compare": compare(rec, other) if other is not None else None,
            "trends": trends(history, str(rec.get("id"))), "states": STATE_TEXT}
