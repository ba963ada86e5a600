"""Conditional vertices in a plan (docs/FORMATS.md, "Conditional vertices").

A TaskGraph vertex may be conditional on flags (`TaskGraph.condition`: a column of a kernel's
[rows, n] output, e.g. a mixture-of-experts router's choice): at run time it is skipped unless
the column has a non-zero row. The plan stays static: it reserves and orders every conditional
vertex as if it ran, so the dependency counts, the memory edges and the verifier are those of
an ordinary plan; the worker decides at run time, when the vertex is ready, whether to do its
work. For the worker to know, the flag's writer must be done first:

- `after_flags` moves each conditional vertex after the writers of its flags in the serial order
  V (a stable re-sort), so the simulation loads an expert's weights after its router ran, never
  prefetching one that the step may not route to;
- `condition` marks every MemGraph vertex of a conditional value (its load, kernel, offload,
  reload) with `when` (the flag writers' MemGraph ids and columns) and adds an edge from each
  flag writer. Ids are a topological order, so an edge from a lower id cannot close a cycle; a
  vertex whose flag writer comes later (none after `after_flags`) stays unconditional.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from disco_ray.graph.errors import GraphError
from disco_ray.graph.memgraph import Edges, MemGraph, MKind, edge_columns
from disco_ray.graph.taskgraph import TaskGraph

from .dense import Dense
from .verify_common import Sink, describe


def after_flags(d: Dense, tg: TaskGraph, seq: Sequence[int]) -> list[int]:
    """Serial order `seq` (Dense positions) with each conditional vertex after its flags'
    writers, otherwise in `seq`'s order (Kahn's algorithm, lowest position first)."""
    pos = {k: n for n, k in enumerate(seq)}
    preds: list[list[int]] = [list(ins) for ins in d.operands]
    for v in tg:
        if v.when:
            preds[d.index[v.id]] += [d.index[f] for f, _ in v.when]
    left = [len(set(p)) for p in preds]
    succs: list[list[int]] = [[] for _ in preds]
    for k, p in enumerate(preds):
        for u in set(p):
            succs[u].append(k)
    heap = [pos[k] for k in seq if left[k] == 0]
    heapq.heapify(heap)
    out: list[int] = []
    while heap:
        k = seq[heapq.heappop(heap)]
        out.append(k)
        for w in succs[k]:
            left[w] -= 1
            if left[w] == 0:
                heapq.heappush(heap, pos[w])
    if len(out) < len(seq):  # a cycle through a condition: some flag depends on its vertex
        placed = set(out)
        k = next(k for k in seq if k not in placed and tg[d.ids[k]].when)
        raise GraphError(
            f"vertex {d.ids[k]!r}: conditional on flag(s) {[f for f, _ in tg[d.ids[k]].when]}, "
            "one of which depends on it"
        )
    return out


def condition(mg: MemGraph, tg: TaskGraph) -> MemGraph:
    """`mg` with the vertices of `tg`'s conditional values marked `when` and an edge from each
    flag's writer to them; statistics under "conditional"."""
    writer = {v.value: v.id for v in mg.vertices if v.kind is MKind.KERNEL and v.acc is None}
    verts = list(mg.vertices)
    us: list[int] = []
    ws: list[int] = []
    marked = late = 0
    for n, v in enumerate(verts):
        when = tg[v.value].when
        if not when:
            continue
        srcs = tuple((writer[f], i) for f, i in when)
        if any(u >= v.id or mg.vertex(u).gpu != v.gpu for u, _ in srcs):
            late += 1  # it runs whatever the flags say: always correct, never skipped
            continue
        verts[n] = dataclasses.replace(v, when=srcs)
        marked += 1
        for u in dict.fromkeys(u for u, _ in srcs):
            us.append(u)
            ws.append(v.id)
    u0, w0, m0 = edge_columns(mg.edges)
    have = set(zip(u0[np.isin(w0, ws)].tolist(), w0[np.isin(w0, ws)].tolist()))
    new = [(u, w) for u, w in zip(us, ws) if (u, w) not in have]
    ua = np.concatenate((u0, np.array([e[0] for e in new], dtype=np.int64)))
    wa = np.concatenate((w0, np.array([e[1] for e in new], dtype=np.int64)))
    mem = np.concatenate((m0, np.zeros(len(new), dtype=bool)))
    by = np.argsort(wa, kind="stable")
    stats = dict(mg.stats)
    stats["conditional"] = {
        "vertices": marked,
        "flags": len(set(us)),
        "edges_added": len(new),
        "unconditional": late,
    }
    out = MemGraph(
        list(mg.capacity),
        verts,
        Edges(ua[by], wa[by], mem[by]),
        dict(mg.outputs),
        list(mg.host_capacity),
        stats,
        list(mg.disk_capacity),
    )
    return out


def check_when(tg: TaskGraph, mg: MemGraph, pos: dict[int, int], reach, sink: Sink) -> None:
    """The `when` of each vertex names, for each of its value's TaskGraph conditions, the kernel
    on its GPU that writes that flag, an ancestor of the vertex (the worker reads the flag
    before deciding); a vertex of a conditional value may also run unconditionally."""
    u: list[int] = []
    w: list[int] = []
    for v in mg.vertices:
        if not v.when:
            continue
        want = tg[v.value].when if v.value in tg else ()
        got = []
        for src, n in v.when:
            s = mg.vertices[pos[src]] if src in pos else None
            if s is None or s.kind is not MKind.KERNEL or s.gpu != v.gpu:
                sink.add(f"{describe(v)}: when names vertex {src}, not a kernel on gpu:{v.gpu}")
                continue
            got.append((s.value, n))
            u.append(pos[src])
            w.append(pos[v.id])
        if got and sorted(got) != sorted(want):
            sink.add(f"{describe(v)}: when {got} differs from its value's conditions {list(want)}")
    if u:
        ok = reach.ancestors(np.array(u, dtype=np.int64), np.array(w, dtype=np.int64))
        for a, b, fine in zip(u, w, ok.tolist()):
            if not fine:
                sink.add(
                    f"{describe(mg.vertices[b])}: its flag writer vertex {mg.vertices[a].id} is not before it"
                )
