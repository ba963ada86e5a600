"""Run traces and statistics: Chrome/Perfetto trace-event JSON and a summary of one run.

A record is (vertex id, stream, start ns, end ns) as a worker measured it (wall clock, time.time_ns
base, so records of workers in different processes of one node line up). In the trace, pid is the
GPU and tid the stream; each vertex is a complete event ("ph": "X", ts/dur in us, `cat` its kind)
whose args give the vertex id, kind, value and bytes written. Besides (Chrome/Perfetto
trace-event format):

- counter events ("ph": "C") per GPU, "arena bytes", "host store bytes" and "spill file bytes": the bytes the plan
  holds in use over time, each range from the start of the vertex writing it to the end of its
  last reader (outputs to the end of the run);
- flow events ("ph": "s" / "f", one id per transfer): an arrow from the vertex on the source GPU
  that produced a transfer's value to the transfer on the destination GPU.

Open the file in https://ui.perfetto.dev or chrome://tracing, or draw it with `disco-ray plot`.

Busy fractions are the union of a GPU's intervals of one class divided by the makespan:
compute = kernel, h2d = input + reload, d2h = offload, transfer = GPU-to-GPU pulls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from disco_ray.graph.files import replacing
from disco_ray.graph.formats import write_doc
from disco_ray.graph.memgraph import DISK, HOST, MemGraph, MKind

Record = tuple[int, int, int, int]
CLASS = {"kernel": "compute", "input": "h2d", "reload": "h2d", "offload": "d2h", "transfer": "transfer"}


COUNTERS = ("arena bytes", "host store bytes", "spill file bytes")


def occupancy(
    mg: MemGraph, records: Sequence[Sequence[Record]]
) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """(GPU, counter name) -> [(ns, bytes in use from then on)]: each arena or host-store range a
    vertex writes is in use from that vertex's start to the end of its last reader; to the end of
    the run for what the plan keeps (outputs); to its own end for a value nobody reads (an input
    loaded, then evicted before its first use: the plan reloads it)."""
    when = {vid: (g, a, b) for g, recs in enumerate(records) for vid, _, a, b in recs}
    if not when:
        return {}
    end = max(b for _, a, b in when.values())
    last: dict[int, int] = {}
    for v in mg.vertices:
        for r in v.ins:
            if r.src is not None and v.id in when:
                last[r.src] = max(last.get(r.src, 0), when[v.id][2])
    kept = set(mg.outputs.values())
    steps: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for v in mg.vertices:
        if v.id not in when or v.out.device not in (v.gpu, HOST, DISK):
            continue
        g, a, b = when[v.id]
        name = COUNTERS[0] if v.out.device == v.gpu else COUNTERS[1] if v.out.device == HOST else COUNTERS[2]
        stop = end if v.id in kept else last.get(v.id, b)
        steps.setdefault((g, name), []).extend([(a, v.out.nbytes), (max(stop, a), -v.out.nbytes)])
    out = {}
    for key, ev in steps.items():
        ev.sort()
        level = 0
        curve: list[tuple[int, int]] = []
        for t, d in ev:
            level += d
            if curve and curve[-1][0] == t:
                curve[-1] = (t, level)
            else:
                curve.append((t, level))
        out[key] = curve
    return out


def _flows(mg: MemGraph, records: Sequence[Sequence[Record]], t0: int) -> list[dict]:
    """A flow arrow per transfer, from the end of the vertex that wrote its source to its start."""
    at = {vid: (g, s, a, b) for g, recs in enumerate(records) for vid, s, a, b in recs}
    events: list[dict] = []
    for v in mg.vertices:
        src = v.ins[0].src if v.kind is MKind.TRANSFER and v.ins else None
        if src is None or src not in at or v.id not in at:
            continue
        g0, s0, _, b0 = at[src]
        g1, s1, a1, _ = at[v.id]
        common = {"name": "transfer", "cat": "transfer", "id": v.id}
        # the ends lie just inside the two slices, which the viewer binds them to
        events.append({**common, "ph": "s", "pid": g0, "tid": s0, "ts": (b0 - t0) / 1e3 - 1e-3})
        events.append({**common, "ph": "f", "bp": "e", "pid": g1, "tid": s1, "ts": (a1 - t0) / 1e3 + 1e-3})
    return events


def chrome_trace(mg: MemGraph, records: Sequence[Sequence[Record]]) -> dict:
    """The trace-event document of one run (records per GPU): slices, counters, flows."""
    t0 = min((r[2] for recs in records for r in recs), default=0)
    events: list[dict] = []
    for g, recs in enumerate(records):
        events.append({"name": "process_name", "ph": "M", "pid": g, "tid": 0, "args": {"name": f"gpu:{g}"}})
        for s in sorted({r[1] for r in recs}):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": g, "tid": s, "args": {"name": f"stream {s}"}}
            )
        for vid, s, a, b in recs:
            v = mg.vertex(vid)
            events.append(
                {
                    "name": f"{v.kind.value} {v.value}",
                    "cat": v.kind.value,
                    "ph": "X",
                    "pid": g,
                    "tid": s,
                    "ts": (a - t0) / 1e3,
                    "dur": (b - a) / 1e3,
                    "args": {
                        "vertex": vid,
                        "kind": v.kind.value,
                        "value": v.value,
                        "bytes": v.out.nbytes,
                        **({"tier": "disk"} if _on_disk(v) else {}),
                    },
                }
            )
    for (g, name), curve in sorted(occupancy(mg, records).items()):
        events += [
            {"name": name, "ph": "C", "pid": g, "tid": 0, "ts": (t - t0) / 1e3, "args": {"bytes": n}}
            for t, n in curve
        ]
    events += _flows(mg, records, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _on_disk(v) -> bool:
    """An offload to or a reload from the spill file (the disk lanes)."""
    if v.kind is MKind.OFFLOAD:
        return v.out.device == DISK
    return v.kind is MKind.RELOAD and bool(v.ins) and v.ins[0].loc.device == DISK


def summarize(mg: MemGraph, records: Sequence[Sequence[Record]], wall_s: float | None = None) -> dict:
    """Makespan, per-GPU busy fractions by class, bytes moved by kind, vertices per second."""
    flat = [r for recs in records for r in recs]
    if not flat:
        return {
            "vertices": 0,
            "makespan_s": 0.0,
            "wall_s": wall_s,
            "gpus": [],
            "bytes": {},
            "vertices_per_s": 0.0,
        }
    t0 = min(r[2] for r in flat)
    t1 = max(r[3] for r in flat)
    span = max(t1 - t0, 1)
    moved: dict[str, int] = {}
    gpus = []
    for g, recs in enumerate(records):
        by_class: dict[str, list[tuple[int, int]]] = {
            c: [] for c in ("compute", "h2d", "d2h", "transfer", "disk")
        }
        for vid, _, a, b in recs:
            v = mg.vertex(vid)
            disk = _on_disk(v)
            by_class["disk" if disk else CLASS[v.kind.value]].append((a, b))
            if v.kind.value == "input" and a == b:
                continue  # kept in the arena from an earlier run (a skipped load): nothing moved
            if v.kind.value != "kernel":
                moved[v.kind.value] = moved.get(v.kind.value, 0) + v.out.nbytes
            if disk:  # also counted in "offload" / "reload" above
                key = f"{v.kind.value}_disk"
                moved[key] = moved.get(key, 0) + v.out.nbytes
        gpus.append(
            {
                "gpu": g,
                "vertices": len(recs),
                **{f"busy_{c}": round(_union_ns(iv) / span, 4) for c, iv in by_class.items()},
            }
        )
    makespan = span / 1e9
    return {
        "vertices": len(flat),
        "makespan_s": makespan,
        "wall_s": wall_s,
        "gpus": gpus,
        "bytes": moved,
        "vertices_per_s": len(flat) / (wall_s if wall_s else makespan),
    }


def write_trace(
    path: str, mg: MemGraph, records: Sequence[Sequence[Record]], summary: dict | None = None
) -> None:
    """Writes the trace-event JSON (atomically), with the summary under "otherData"."""
    doc = chrome_trace(mg, records)
    if summary is not None:
        doc["otherData"] = {**summary, "capacity": list(mg.capacity)}
    if str(path).endswith(".json"):
        write_doc(doc, path)
    else:
        with replacing(path) as tmp, open(tmp, "w") as f:
            json.dump(doc, f)


def format_summary(s: dict) -> str:
    """A few human-readable lines."""
    lines = [
        f"{s['vertices']} vertices in {s['makespan_s'] * 1e3:.2f} ms ({s['vertices_per_s']:.0f} vertices/s)"
        + (" (cold: the plan's first run, with its one-time costs)" if s.get("cold") else "")
    ]
    for g in s["gpus"]:
        lines.append(
            f"  gpu:{g['gpu']}: {g['vertices']} vertices, busy compute {g['busy_compute']:.0%} "
            f"h2d {g['busy_h2d']:.0%} d2h {g['busy_d2h']:.0%} transfer {g['busy_transfer']:.0%}"
            + (f" disk {g['busy_disk']:.0%}" if g.get("busy_disk") else "")
        )
    if s["bytes"]:
        lines.append("  bytes moved: " + ", ".join(f"{k} {v}" for k, v in sorted(s["bytes"].items())))
    d = s.get("disk")
    if d:
        for w in d["workers"]:
            lines.append(
                f"  disk gpu:{w['gpu']}: wrote {w['bytes_written']} B in {w['write_s'] * 1e3:.1f} ms, read "
                f"{w['bytes_read']} B in {w['read_s'] * 1e3:.1f} ms ({'O_DIRECT' if w['direct'] else 'buffered'})"
            )
        lines.append(
            f"  disk bandwidth: write {d['write_gb_per_s'] or 0:.3f} GB/s, read {d['read_gb_per_s'] or 0:.3f} GB/s"
        )
    if s.get("placement"):
        lines.extend(format_placement(s["placement"]))
    return "\n".join(lines)


def format_placement(p: dict) -> list[str]:
    """Summary lines: each worker's node, and the transfer paths used."""
    short = {n: f"node{i}" for i, n in enumerate(dict.fromkeys(w["node_id"] for w in p["workers"]))}
    lines = [f"  placement {p['strategy']} on {p['nodes']} node(s), {p['gpus_per_worker']:g} GPU per worker"]
    for w in p["workers"]:
        lines.append(f"    gpu:{w['gpu']} on {short[w['node_id']]} {w['node_id'][:12]} ({w['ip']})")
    if p["paths"]:
        lines.append("  transfer paths: " + ", ".join(f"{k} {v}" for k, v in p["paths"].items()))
    for pair, why in p.get("fallbacks", {}).items():  # a cuda pair on the object store, and why
        lines.append(f"    {pair} object-store (fallback): {why}")
    return lines
