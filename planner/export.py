"""Writing the MemGraph of a simulation (planner.number), or of the parts of a split one
(planner.split): the transfers between parts joined, the vertices placed by id, the edges as
columns sorted by target with the implied ones dropped (planner.prune), and the statistics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from disco_ray.graph.errors import PlanError
from disco_ray.graph.memgraph import DISK, Edges, MemGraph, MemVertex, MKind, new_read, new_vertex

from .prune import WINDOW, reduce_columns
from .records import DATA, MEM, Part


def export(
    parts: Sequence[Part],
    names: Sequence[str],
    kept: Sequence[int],
    caps: Sequence[int],
    host_budget: Sequence[int | None],
    started: float,
    window: int = WINDOW,
) -> MemGraph:
    """The MemGraph of `parts` (every part's numbered simulation, this process's own included).

    Args:
        parts: the parts, numbered (planner.number).
        names: the TaskGraph's vertex ids by position; kept: the positions of the values kept.
        caps: arena bytes per GPU; host_budget: the host stores' budgets (statistics).
        started: when planning began (time.perf_counter).
        window: the span below which implied memory edges are dropped.
    """
    counts = {k: sum(p.counts[k] for p in parts) for k in parts[0].counts}
    built = sum(p.built for p in parts)
    superfluous, held = merge(parts)
    counts["superfluous_mem_edges"] += superfluous
    built -= superfluous
    verts = _vertices(parts, held, names)
    edges, implied = _edges(parts, held, len(verts), window)
    outputs = {}
    for o in kept:
        for part in parts:
            if o in part.outputs:
                outputs[names[o]] = part.outputs[o]
    counts["superfluous_mem_edges"] += implied
    peaks = [(0, 0, 0, 0, 0)] * len(caps)
    for part in parts:
        for g, pk in part.peaks.items():
            peaks[g] = pk
    moved, disk = _moved(verts)
    stats = {
        "planning_seconds": round(time.perf_counter() - started, 4),
        **moved,
        "peak_gpu_bytes": [pk[0] for pk in peaks],
        "peak_host_bytes": [pk[1] for pk in peaks],
        "peak_disk_bytes": [pk[3] for pk in peaks],
        **disk,
        "host_budget": host_budget,
        **counts,
        "implied_mem_edges": implied,
        "mem_edges_built": built,
    }
    host_cap = [pk[2] for pk in peaks]
    disk_cap = [pk[4] for pk in peaks]
    return MemGraph(list(caps), verts, edges, outputs, host_cap, stats, disk_cap)


def _vertices(
    parts: Sequence[Part], held: list[tuple[tuple, dict[int, bool]]], names: Sequence[str]
) -> list[MemVertex]:
    """Every part's vertices, and the transfers between parts, placed by id."""
    n = sum(len(p.rows) for p in parts) + len(held)
    verts: list[MemVertex] = [None] * n  # type: ignore[list-item]
    for p in parts:
        if p.table is None:  # this process's own
            for v in p.rows:
                verts[v.id] = v
            continue
        made = [new_read(names[val], src, loc) for val, src, loc in p.table]
        take = made.__getitem__
        for i, kind, value, gpu, reads, out, acc in p.rows:
            verts[i] = new_vertex(i, kind, names[value], gpu, tuple(map(take, reads)), out, acc)
    for (i, kind, value, gpu, reads, out, acc), _ in held:  # read as merge made it
        ins = tuple(new_read(names[val], src, loc) for val, src, loc in reads)
        verts[i] = new_vertex(i, kind, names[value], gpu, ins, out, acc)
    return verts


def _edges(
    parts: Sequence[Part], held: list[tuple[tuple, dict[int, bool]]], n: int, window: int
) -> tuple[Edges, int]:
    """The edges as columns sorted by target, those implied within `window` dropped; and how
    many were dropped."""
    cols = [p.edges for p in parts]
    if held:  # the transfers between parts, merged: their preds by id
        us: list[int] = []
        ws: list[int] = []
        kinds: list[bool] = []
        for (i, *_), preds in held:
            us.extend(preds)
            kinds.extend(preds.values())
            ws.extend([i] * len(preds))
        cols.append((np.array(us, dtype=np.int64), np.array(ws, dtype=np.int64), np.array(kinds, dtype=bool)))
    u, w, mem = (np.concatenate(c) for c in zip(*cols))
    if len(cols) > 1:  # each part's edges come sorted by target
        by = np.argsort(w, kind="stable")
        u, w, mem = u[by], w[by], mem[by]
    try:  # section 7: every edge points forward in V
        keep, implied = reduce_columns(u, w, mem, n, window)
    except ValueError as e:
        raise PlanError(f"internal: {e}") from None
    if keep is not None:
        u, w, mem = u[keep], w[keep], mem[keep]
    return Edges(u, w, mem), implied


def _moved(verts: Sequence[MemVertex]) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes offloaded and reloaded, in all and to or from disk (statistics)."""
    moved = {MKind.OFFLOAD: 0, MKind.RELOAD: 0}
    disk = {MKind.OFFLOAD: 0, MKind.RELOAD: 0}
    for v in verts:
        if v.kind in moved:
            moved[v.kind] += v.out.nbytes
            if (v.out if v.kind is MKind.OFFLOAD else v.ins[0].loc).device == DISK:
                disk[v.kind] += v.out.nbytes
    return (
        {"bytes_offloaded": moved[MKind.OFFLOAD], "bytes_reloaded": moved[MKind.RELOAD]},
        {"bytes_offloaded_disk": disk[MKind.OFFLOAD], "bytes_reloaded_disk": disk[MKind.RELOAD]},
    )


def merge(parts: Sequence[Part]) -> tuple[int, list[tuple[tuple, dict[int, bool]]]]:
    """Gives every transfer between two parts its read, as the part of its source made it: the
    operand's location and writer, and data edges from its writers. Returns how many memory edges
    that turned into data edges (superfluous ones, as in a one-process plan) and the transfers'
    (row, preds).
    """
    held: dict[int, tuple[tuple, dict[int, bool]]] = {}
    for part in parts:
        held.update(part.held)
    superfluous = 0
    for part in parts:
        for k, x, src, writers, loc in part.xreads:
            row, preds = held.get(k, ((), {}))
            if not row or row[4]:
                raise PlanError(f"internal: transfer {k} read by two parts, or by none")
            row[4].append((x, src, loc))
            for u in writers or (src,):
                if preds.get(u) is MEM:
                    superfluous += 1
                preds[u] = DATA
    if any(not row[4] for row, _ in held.values()):
        raise PlanError("internal: a transfer between plan parts was never read")
    return superfluous, list(held.values())
