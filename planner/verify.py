"""The MemGraph verifier: checks the correctness conditions at the end of FORMATS.md.

A MemGraph is correct when it is acyclic, every range lies inside its arena, every TaskGraph
kernel/transfer is realised once with the right operands, every read names a source that wrote
exactly that value at exactly that place and happens before the reader, no other writer of an
overlapping range can run between a source and any of its readers, and every output is still in
place at the end (TURNIP section 6: "v1 safely overwrites v2").

A sum-into group (the MemGraph vertices with `accumulate`, TURNIP appendix A) realises one
`accumulate`: parts 0..n-1 once each, part i reading operand i, all writing one range; its
readers name its last member (the runtime's alias) and must follow every member. For the race
check the group is one writer G of its range: "u before G" means u before every member, "G
before w" every member before w, so a writer that may land between two members, or between a
member and a reader, is caught like any other race.

This module checks the structure (kinds, ranges, capacities, groups, provenance, acyclicity);
the order conditions become a batch of "is u an ancestor of w?" questions (planner.verify_order):
each read's source before its reader, and, per arena, the few writer orderings that rule out
every race (planner.overlap), answered together by planner.reach in memory linear in the graph
(an n x n/8-byte bit matrix would need ~18 GB for a 65B prefill plan). Rejected: all-pairs
overlap tests (quadratic in Python) and per-pair graph searches.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import cast

from disco_ray.graph.errors import VerifyError
from disco_ray.graph.memgraph import DISK, HOST, INPUT, TIERS, Loc, MemGraph, MemVertex, MKind
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .conditions import check_when
from .reach import Reach
from .verify_common import Full, Groups, Sink, describe, where
from .verify_order import check_order


def verify(tg: TaskGraph, mg: MemGraph, limit: int = 20) -> list[str]:
    """Returns up to `limit` one-line violations of FORMATS.md's correctness conditions ([] if none)."""
    sink = Sink(max(1, limit))
    with contextlib.suppress(Full):
        _verify(tg, mg, sink)
    return sink.msgs


def check(tg: TaskGraph, mg: MemGraph, limit: int = 5) -> None:
    """Raises VerifyError naming the first violations, if any."""
    msgs = verify(tg, mg, limit)
    if msgs:
        more = f" (and possibly more; first {len(msgs)} shown)" if len(msgs) >= limit else ""
        raise VerifyError(f"MemGraph is incorrect{more}: " + "; ".join(msgs))


def check_acyclic(mg: MemGraph) -> None:
    """Raises VerifyError naming a cycle (by vertex ids) or an edge to an unknown vertex: the one
    check even a trusted plan gets, since a cycle would leave the runtime waiting for ever."""
    pos = {v.id: i for i, v in enumerate(mg.vertices)}
    preds: list[list[int]] = [[] for _ in mg.vertices]
    for e in mg.edges:
        if e[0] not in pos or e[1] not in pos:
            raise VerifyError(f"MemGraph is incorrect: edge {e[0]} -> {e[1]} names an unknown vertex")
        preds[pos[e[1]]].append(pos[e[0]])
    sink = Sink(1)
    with contextlib.suppress(Full):
        _topo(preds, mg.vertices, sink)
    if sink.msgs:
        raise VerifyError(f"MemGraph is incorrect: {sink.msgs[0]}")


def _verify(tg: TaskGraph, mg: MemGraph, sink: Sink) -> None:
    if mg.gpus != tg.gpus:  # run refuses it too: a plan is for exactly the TaskGraph's GPUs
        sink.add(f"the MemGraph has {mg.gpus} devices, the TaskGraph {tg.gpus} GPU(s)")
    verts = mg.vertices
    n = len(verts)
    pos: dict[int, int] = {}
    for i, v in enumerate(verts):
        if v.id in pos:
            sink.add(f"{describe(v)}: duplicate vertex id")
        pos[v.id] = i
    preds: list[list[int]] = [[] for _ in range(n)]
    for e in mg.edges:
        u, w = e[0], e[1]
        if u not in pos or w not in pos:
            sink.add(f"edge {u} -> {w} names an unknown vertex")
            continue
        preds[pos[w]].append(pos[u])
    order = _topo(preds, verts, sink)
    if order is None:
        return  # the remaining checks need a topological order
    _check_kinds_and_capacity(mg, sink)
    _check_host_use(mg, sink)
    groups = _check_groups(tg, mg, sink)
    _check_provenance(tg, mg, groups, sink)
    reach = Reach([list(set(ps)) for ps in preds], order)
    check_order(tg, mg, pos, reach, groups, sink)
    check_when(tg, mg, pos, reach, sink)


def _check_groups(tg: TaskGraph, mg: MemGraph, sink: Sink) -> Groups:
    verts = mg.vertices
    by_value: dict[str, list[int]] = defaultdict(list)
    for i, v in enumerate(verts):
        if v.acc is not None:
            by_value[v.value].append(i)
    gs = Groups()
    for name, ms in by_value.items():
        t = tg.vertices.get(name)
        if t is None or t.op != "accumulate":
            what = "not a TaskGraph vertex" if t is None else f"a {t.kind.value} {t.op or ''}".rstrip()
            sink.add(f"{describe(verts[ms[0]])}: sum-into of {name!r}, which is {what}, not an accumulate")
            continue
        n = len(t.inputs)
        rep = max(ms, key=lambda i: verts[i].id)
        r = verts[rep]
        seen: dict[int, int] = {}
        for i in ms:
            v = verts[i]
            part, parts = cast("tuple[int, int]", v.acc)
            if parts != n:
                sink.add(f"{describe(v)}: says {parts} parts, {name!r} has {n} operands")
            if part in seen:
                sink.add(f"{describe(v)}: part {part} of {name!r} is also {describe(verts[seen[part]])}")
            seen[part] = i
            want = t.inputs[part] if part < n else None
            if len(v.ins) != 1 or v.ins[0].value != want:
                sink.add(
                    f"{describe(v)}: reads {[x.value for x in v.ins]}, part {part} of {name!r} reads "
                    f"its operand {want!r}"
                )
            if v.out != r.out or v.gpu != r.gpu:
                sink.add(
                    f"{describe(v)}: writes {where(v.out, v.gpu)}, its group writes {where(r.out, r.gpu)}"
                )
        missing = [p for p in range(n) if p not in seen]
        if missing:
            sink.add(f"sum-into group of {name!r} (gpu:{r.gpu}): parts {missing} of {n} have no member")
        g = len(gs.names)
        gs.names.append(name)
        gs.members.append(ms)
        gs.rep.append(rep)
        for i in ms:
            if verts[i].out == r.out and verts[i].gpu == r.gpu:
                gs.of[i] = g
    return gs


def _topo(preds: list[list[int]], verts: list[MemVertex], sink: Sink) -> list[int] | None:
    """Kahn's algorithm over positions; reports a cycle (by vertex ids) and returns None if there is one."""
    n = len(verts)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for w, ps in enumerate(preds):
        for u in set(ps):
            succ[u].append(w)
            indeg[w] += 1
    stack = [i for i in range(n) if indeg[i] == 0]
    order: list[int] = []
    while stack:
        u = stack.pop()
        order.append(u)
        for w in succ[u]:
            indeg[w] -= 1
            if indeg[w] == 0:
                stack.append(w)
    if len(order) == n:
        return order
    # every vertex left has a predecessor left: walk back until one repeats
    seen: dict[int, int] = {}
    path: list[int] = []
    v = next(i for i in range(n) if indeg[i] > 0)
    while v not in seen:
        seen[v] = len(path)
        path.append(v)
        v = next(u for u in preds[v] if indeg[u] > 0)
    cycle = [*path[seen[v] :], v][::-1]
    sink.add("cycle through vertices " + " -> ".join(str(verts[i].id) for i in cycle))
    return None


def _check_host_use(mg: MemGraph, sink: Sink) -> None:
    """Each GPU's host-store use (its host ranges' end, written or read) within its declared host
    capacity: a missing or 0 declaration allows no host range, as the arena's capacity allows none
    beyond it."""
    peak: dict[int, tuple[int, MemVertex, Loc]] = {}
    for v in mg.vertices:
        for loc in (v.out, *(r.loc for r in v.ins)):
            if loc.device == HOST and loc.end > peak.get(v.gpu, (0,))[0]:
                peak[v.gpu] = (loc.end, v, loc)
    for g in sorted(peak):
        use, v, loc = peak[g]
        cap = mg.host_capacity[g] if 0 <= g < len(mg.host_capacity) else 0
        if use > cap:
            sink.add(
                f"{describe(v)}: host store use of {use} bytes (up to {where(loc, g)}) exceeds the "
                f"host store capacity {cap} of gpu:{g}"
            )


def _check_kinds_and_capacity(mg: MemGraph, sink: Sink) -> None:
    gpus = mg.gpus
    disk_cap = mg.disk_capacity  # the host store's capacity: _check_host_use

    def in_gpu(v: MemVertex, loc: Loc, what: str) -> None:
        if loc.device >= gpus:
            sink.add(
                f"{describe(v)}: {what} {where(loc, v.gpu)} names a GPU this MemGraph lacks ({gpus} GPUs)"
            )
        elif loc.device >= 0 and loc.end > mg.capacity[loc.device]:
            sink.add(
                f"{describe(v)}: {what} {where(loc, v.gpu)} exceeds gpu:{loc.device} capacity "
                f"{mg.capacity[loc.device]}"
            )

    for v in mg.vertices:
        if not 0 <= v.gpu < gpus:
            sink.add(f"{describe(v)}: runs on a GPU this MemGraph lacks ({gpus} GPUs)")
            continue
        o, k = v.out, v.kind
        in_gpu(v, o, "output")
        for r in v.ins:
            in_gpu(v, r.loc, f"read of {r.value!r} at")
        if o.device == DISK and v.gpu < len(disk_cap) and 0 < disk_cap[v.gpu] < o.end:
            sink.add(
                f"{describe(v)}: output {where(o, v.gpu)} exceeds the spill file capacity "
                f"{disk_cap[v.gpu]} of gpu:{v.gpu}"
            )
        if o.device == INPUT:
            sink.add(f"{describe(v)}: writes {where(o, v.gpu)}, the caller's read-only input copies")
        if k is MKind.OFFLOAD:
            if o.device not in TIERS:
                sink.add(
                    f"{describe(v)}: an offload must write the host store or the spill file, writes "
                    f"{where(o, v.gpu)}"
                )
            if len(v.ins) != 1 or v.ins[0].loc.device != v.gpu:
                sink.add(
                    f"{describe(v)}: an offload must read one range of its own gpu:{v.gpu}, reads "
                    + ", ".join(where(r.loc, v.gpu) for r in v.ins)
                )
        elif k is MKind.RELOAD:
            if len(v.ins) != 1 or v.ins[0].loc.device not in (HOST, DISK, INPUT):
                sink.add(
                    f"{describe(v)}: a reload must read one host, disk or input range, reads "
                    + ", ".join(where(r.loc, v.gpu) for r in v.ins)
                )
        elif k is MKind.TRANSFER:
            if len(v.ins) != 1 or not 0 <= v.ins[0].loc.device != v.gpu:
                sink.add(
                    f"{describe(v)}: a transfer must read one range of another GPU, reads "
                    + ", ".join(where(r.loc, v.gpu) for r in v.ins)
                )
        elif k is MKind.KERNEL:
            for r in v.ins:
                if r.loc.device != v.gpu:
                    sink.add(
                        f"{describe(v)}: a kernel must read its own gpu:{v.gpu}, reads {r.value!r} at "
                        f"{where(r.loc, v.gpu)}"
                    )
        elif k is MKind.INPUT and v.ins:
            sink.add(f"{describe(v)}: an input load reads nothing, has {len(v.ins)} reads")
        if k is not MKind.OFFLOAD and o.device != v.gpu:
            sink.add(f"{describe(v)}: a {k.value} must write its own gpu:{v.gpu}, writes {where(o, v.gpu)}")
        if k in (MKind.OFFLOAD, MKind.RELOAD):
            for r in v.ins:
                if r.value != v.value:
                    sink.add(f"{describe(v)}: moves {v.value!r} but reads {r.value!r}")


def _check_provenance(tg: TaskGraph, mg: MemGraph, groups: Groups, sink: Sink) -> None:
    realised: dict[str, list[MemVertex]] = defaultdict(list)
    for i, v in enumerate(mg.vertices):
        t = tg.vertices.get(v.value)
        if t is None:
            sink.add(f"{describe(v)}: value {v.value!r} is not a TaskGraph vertex")
            continue
        if v.acc is not None:  # a group realises its accumulate once; its reads: _check_groups
            if i in groups.of and groups.rep[groups.of[i]] == i:
                realised[v.value].append(v)
        elif v.kind in (MKind.KERNEL, MKind.TRANSFER, MKind.INPUT):
            realised[v.value].append(v)
            if v.kind.value != t.kind.value:
                sink.add(f"{describe(v)}: realises TaskGraph {t.kind.value} {t.id!r}")
                continue
            if t.gpu != v.gpu:
                sink.add(f"{describe(v)}: TaskGraph puts {t.id!r} on gpu:{t.gpu}")
            if v.kind is not MKind.INPUT and tuple(r.value for r in v.ins) != t.inputs:
                sink.add(
                    f"{describe(v)}: reads {[r.value for r in v.ins]}, TaskGraph operands are "
                    f"{list(t.inputs)}"
                )
        if v.out.nbytes < t.nbytes:
            sink.add(
                f"{describe(v)}: output {where(v.out, v.gpu)} holds {v.out.nbytes} bytes, "
                f"{t.id!r} needs {t.nbytes}"
            )
    used: set[str] = set(tg.kept)
    for t in tg:
        used.update(t.inputs)
    for t in tg:
        got = realised.get(t.id, [])
        if t.kind is Kind.INPUT:
            if t.id in used and not got:
                sink.add(f"TaskGraph input {t.id!r} (gpu:{t.gpu}) is used but has no input vertex")
        elif len(got) != 1:
            ids = [v.id for v in got]
            sink.add(
                f"TaskGraph {t.kind.value} {t.id!r} (gpu:{t.gpu}) is realised by {len(got)} "
                f"MemGraph vertices {ids}, not exactly one"
            )
    for name in tg.kept:
        if name not in mg.outputs:
            what = "output" if name in tg.outputs else "carried value"
            sink.add(f"TaskGraph {what} {name!r} has no MemGraph output vertex")
    kept = set(tg.kept)
    for name, vid in mg.outputs.items():
        if name not in kept:
            sink.add(f"MemGraph output {name!r} (vertex {vid}) is not a TaskGraph output or carried value")
