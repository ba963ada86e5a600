"""The verifier's order conditions, as one batch of "is u an ancestor of w?" questions.

Each read's source must come before its reader, and no other writer of an overlapping range may
run between a source and any of its readers: per arena, the few writer orderings that rule out
every race (planner.overlap), answered together by planner.reach in memory linear in the graph. A
sum-into group is one writer of its range ("u before G": u before every member, "G before w":
every member before w), so a writer that may land between two members, or between a member and a
reader, is caught like any other race.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from disco_ray.graph.memgraph import INPUT, TIERS, MemGraph, MKind
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .overlap import ArenaRaces
from .reach import Reach
from .verify_common import Groups, Sink, arena_key, describe, head, where


def _read_pairs(tg: TaskGraph, mg: MemGraph, pos: dict[int, int], sink: Sink) -> np.ndarray:
    """Checks every read's source; returns (src, reader, read index) rows whose order is still to check."""
    verts = mg.vertices
    pairs: list[tuple[int, int, int]] = []  # (src position, reader position, read index)
    for i, v in enumerate(verts):
        for n, r in enumerate(v.ins):
            if r.src is None:
                if not (v.kind is MKind.RELOAD and r.loc.device == INPUT):
                    sink.add(
                        f"{head(v, n)}: no src (allowed only for a reload of a graph input from 'input')"
                    )
                elif r.value not in tg or tg[r.value].kind is not Kind.INPUT:
                    sink.add(
                        f"{head(v, n)}: reads the caller's copy of {r.value!r}, which is not a graph input"
                    )
                continue
            if r.loc.device == INPUT:
                sink.add(f"{head(v, n)}: reads the caller's input copy but names src {r.src}")
                continue
            j = pos.get(r.src)
            if j is None:
                sink.add(f"{head(v, n)}: src {r.src} is not a vertex")
                continue
            s = verts[j]
            if s.value != r.value or s.out != r.loc or (r.loc.device in TIERS and s.gpu != v.gpu):
                sink.add(f"{head(v, n)}: src {describe(s)} wrote {s.value!r} at {where(s.out, s.gpu)}")
            pairs.append((j, i, n))
    return np.array(pairs, dtype=np.int64).reshape(-1, 3)


def _arena_races(
    mg: MemGraph, pos: dict[int, int], rank: np.ndarray, groups: Groups, sink: Sink
) -> list[ArenaRaces]:
    """Per arena, the ancestor questions that rule out every race (planner.overlap); a sum-into
    group is one writer, position len(vertices) + its index, its readers' src."""
    verts = mg.vertices
    big = len(verts)
    writers: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for i, v in enumerate(verts):
        g = groups.of.get(i)
        if g is not None:
            if groups.rep[g] != i:
                continue  # the group writes once, as its last member
            i = big + g
        if v.out.nbytes > 0 and v.out.device != INPUT:
            writers[arena_key(v.out, v.gpu)].append((v.out.offset, v.out.end, i))
    # reads: (offset, end, src position, reader position or -1 for an output, read index)
    reads: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = defaultdict(list)
    for i, v in enumerate(verts):
        for n, r in enumerate(v.ins):
            j = pos.get(r.src) if r.src is not None else None
            if j is None or r.loc.nbytes == 0 or r.loc.device == INPUT:
                continue
            if j in groups.of:
                j = big + groups.of[j]
            reads[arena_key(r.loc, v.gpu)].append((r.loc.offset, r.loc.end, j, i, n))
    for name, vid in mg.outputs.items():
        j = pos.get(vid)
        if j is None:
            sink.add(f"output {name!r}: vertex {vid} does not exist")
            continue
        o = verts[j]
        if o.value != name:
            sink.add(f"output {name!r}: {describe(o)} holds {o.value!r}")
            continue
        if j in groups.of:
            g = groups.of[j]
            if groups.rep[g] != j:
                sink.add(f"output {name!r}: {describe(o)} is not its group's last member")
            j = big + g
        if o.out.nbytes:
            reads[arena_key(o.out, o.gpu)].append((o.out.offset, o.out.end, j, -1, -1))
    return [ArenaRaces(writers.get(key, []), reads[key], rank) for key in sorted(reads)]


def _group_reads(mg: MemGraph, reads: np.ndarray, groups: Groups, sink: Sink) -> np.ndarray:
    """A read of a group's sum names its last member and follows every member: (member, reader,
    read index) rows for the members other than the named one."""
    verts = mg.vertices
    rows: list[tuple[int, int, int]] = []
    for j, i, n in reads.tolist():
        g = groups.of.get(j)
        if g is None:
            continue
        if groups.rep[g] != j:
            sink.add(
                f"{head(verts[i], n)}: src {describe(verts[j])} is not its group's last member "
                f"(vertex {verts[groups.rep[g]].id}), the writer the readers of a sum name"
            )
        rows += [(m, i, n) for m in groups.members[g] if m != j]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def _expand(
    u: np.ndarray, w: np.ndarray, groups: Groups, big: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Questions naming a group (position big + g) become one per member: (u, w, question index)."""
    if not groups.names or not len(u):
        return u, w, np.arange(len(u), dtype=np.int64)
    members = [np.asarray(ms, dtype=np.int64) for ms in groups.members]

    def side(x: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out_x, out_q = [x[x < big]], [q[x < big]]
        for k in np.flatnonzero(x >= big).tolist():
            ms = members[int(x[k]) - big]
            out_x.append(ms)
            out_q.append(np.full(len(ms), q[k], dtype=np.int64))
        return np.concatenate(out_x), np.concatenate(out_q)

    q = np.arange(len(u), dtype=np.int64)
    u2, q2 = side(u, q)
    w2 = w[q2]
    w3, q3 = side(w2, np.arange(len(w2), dtype=np.int64))
    return u2[q3], w3, q2[q3]


def check_order(
    tg: TaskGraph, mg: MemGraph, pos: dict[int, int], reach: Reach, groups: Groups, sink: Sink
) -> None:
    """Every read's source before its reader, no writer racing a read: all asked of `reach` at once."""
    verts = mg.vertices
    big = len(verts)
    reads = _read_pairs(tg, mg, pos, sink)
    greads = _group_reads(mg, reads, groups, sink)
    rank = reach.rank
    if groups.names:  # a group ranks as its last member in the race check's writer order
        rank = np.concatenate((rank, np.array([rank[r] for r in groups.rep], dtype=np.int64)))
    races = _arena_races(mg, pos, rank, groups, sink)
    us = [reads[:, 0], greads[:, 0], *(a.u for a in races)]
    ws = [reads[:, 1], greads[:, 1], *(a.w for a in races)]
    qu, qw, qi = _expand(np.concatenate(us), np.concatenate(ws), groups, big)
    n = max(big, 1)
    uniq, inv = np.unique(qu * n + qw, return_inverse=True)
    each = reach.ancestors(uniq // n, uniq % n)[inv] if len(uniq) else np.ones(0, dtype=bool)
    ok = np.ones(sum(len(x) for x in us), dtype=bool)
    np.logical_and.at(ok, qi, each)  # a question about a group holds when it holds for every member
    for k in np.flatnonzero(~ok[: len(reads)]).tolist():
        s, v = verts[reads[k, 0]], verts[reads[k, 1]]
        sink.add(
            f"{head(v, int(reads[k, 2]))}: src {describe(s)} is not an ancestor (no path {s.id} -> {v.id})"
        )
    at = len(reads)
    for k in np.flatnonzero(~ok[at : at + len(greads)]).tolist():
        s, v = verts[greads[k, 0]], verts[greads[k, 1]]
        sink.add(
            f"{head(v, int(greads[k, 2]))}: reads the sum of {describe(s)}, which is not an ancestor "
            f"(no path {s.id} -> {v.id}; a reader of a sum follows every member)"
        )
    at += len(greads)

    def real(p: int) -> int:
        return p if p < big else groups.rep[p - big]

    for arena in races:
        part = ok[at : at + len(arena.u)]
        at += len(arena.u)
        for s, w, reader, n in arena.violations(part):
            sv, wv = verts[real(s)], verts[real(w)]
            if reader < 0:
                sink.add(
                    f"output {sv.value!r} of {describe(sv)} at {where(sv.out, sv.gpu)} may be overwritten: "
                    f"{describe(wv)} writes {where(wv.out, wv.gpu)} and is not an ancestor of {sv.id}"
                )
            elif reader == w:
                rd = wv.ins[n]
                sink.add(
                    f"{describe(wv)}: output {where(wv.out, wv.gpu)} overlaps its own input "
                    f"{rd.value!r} at {where(rd.loc, wv.gpu)}"
                )
            else:
                rv = verts[reader]
                rd = rv.ins[n]
                sink.add(
                    f"race: {describe(wv)} writes {where(wv.out, wv.gpu)}, overlapping {rd.value!r} at "
                    f"{where(rd.loc, rv.gpu)} written by {sv.id} and read by {describe(rv)}, and can run "
                    f"between them (not an ancestor of {sv.id}, not a descendant of {rv.id})"
                )
