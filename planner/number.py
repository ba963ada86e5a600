"""Numbering a simulation's records (planner.simulation) as MemGraph vertices: a Part.

V[t] itself has one record, and the offloads and reloads made at step t sort just before it by
key (section 7: every edge then points forward), so a record's id is its step plus the offloads
and reloads of smaller key: no part of a split plan (planner.split) needs another's records to
number its own, only the sorted keys of every part's offloads and reloads (`aux`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from disco_ray.graph.memgraph import Loc, new_read, new_vertex

from .records import STEP, Inst, Part, Rec
from .state import State

Xread = tuple[int, int, int, tuple[int, ...] | None, Loc]  # planner.split's reads for other parts


def number(
    sim: State,
    aux: Sequence[int],
    pending: dict[int, int],
    xreads: list[Xread],
    portable: bool = False,
) -> Part:
    """The simulation's vertices with their MemGraph ids, and its GPUs' figures.

    Args:
        sim: a simulation that has run.
        aux: the sorted keys of every part's offloads and reloads (this one's alone when unsplit).
        pending: a split part's transfers from other parts' GPUs -> their records, whose reads
            the source's part made; xreads: the reads it made for transfers to other parts.
        portable: rows as tuples (id, kind, value, gpu, reads, out, acc), to send to the merging
            process, with reads as places in `Part.table` of (value, src id, loc), one per
            resident value, shared by its readers; else MemVertex objects.
    """
    recs = sim.recs
    keys = np.fromiter([r.key for r in recs], np.int64, len(recs))
    idn = (keys >> STEP) + np.searchsorted(np.asarray(aux, dtype=np.int64), keys)
    ids: list[int] = idn.tolist()
    rows, table, held, edges = _rows(recs, idn, ids, sim.d.ids, pending, portable)
    gpu, mine = sim.d.gpu, set(sim.gpus)
    outputs = {}
    for o in sim.d.kept:
        if gpu[o] in mine:
            inst = sim.resident[o]
            outputs[o] = ids[inst.src if inst is not None else cast(int, sim.host[o][1])]
    peaks = {
        g: (sim.arenas[g].peak, sim.hosts[g].peak, sim.hosts[g].high, sim.disks[g].peak, sim.disks[g].high)
        for g in sim.gpus
    }
    xr = [
        (k, x, ids[src], None if ws is None else tuple(ids[w] for w in ws), loc)
        for k, x, src, ws, loc in xreads
    ]
    return Part(
        rows,
        edges,
        sim.gpus,
        outputs,
        peaks,
        dict(sim.counts),
        sim.built,
        held,
        xr,
        table if portable else None,
    )


def _rows(
    recs: list[Rec],
    idn: np.ndarray,
    ids: list[int],
    names: Sequence[str],
    pending: dict[int, int],
    portable: bool,
) -> tuple[
    list, list[tuple[int, int | None, Loc]], dict[int, tuple], tuple[np.ndarray, np.ndarray, np.ndarray]
]:
    """The records' rows in id order, the reads' table (when portable), the held transfers and
    the edges as columns (u, w, mem) sorted by target."""
    pending_of = {r: k for k, r in pending.items()}
    rows: list = []
    table: list[tuple[int, int | None, Loc]] = []  # when portable: the reads, one per resident value
    held: dict[int, tuple] = {}
    us: list[int] = []  # the edges, flat: preds by record, kinds, and per target its id and count
    kinds: list[bool] = []
    ws: list[int] = []
    counts: list[int] = []
    for r in np.argsort(idn, kind="stable").tolist():  # in id order: the edges come sorted by target
        rec = recs[r]
        if rec.out is None:  # a phantom
            continue
        reads: list = []  # Read objects, or when portable their places in `table`
        for x in rec.ins:
            if type(x) is Inst:
                rd = x.read
                if rd is None:
                    if portable:
                        rd = x.read = len(table)  # type: ignore[assignment]
                        table.append((x.value, ids[x.src], x.loc))
                    else:
                        rd = x.read = new_read(names[x.value], ids[x.src], x.loc)
            else:
                val, src, loc = x  # type: ignore[misc]  # a reload's (value, src, loc)
                src = None if src is None else ids[src]
                if portable:
                    rd = len(table)  # type: ignore[assignment]
                    table.append((val, src, loc))
                else:
                    rd = new_read(names[val], src, loc)
            reads.append(rd)
        deps = rec.deps
        if r in pending_of:  # its read comes from the part of its source (planner.export.merge)
            merged: list = []  # (value, src id, loc) of its read, from planner.export.merge
            row = (ids[r], rec.kind, rec.value, rec.gpu, merged, rec.out, rec.acc)
            held[pending_of[r]] = (row, {ids[u]: kind for u, kind in deps.items()})
        else:
            if portable:
                rows.append((ids[r], rec.kind, rec.value, rec.gpu, reads, rec.out, rec.acc))
            else:
                rows.append(
                    new_vertex(ids[r], rec.kind, names[rec.value], rec.gpu, tuple(reads), rec.out, rec.acc)
                )
            if deps:
                us.extend(deps)
                kinds.extend(deps.values())
                ws.append(ids[r])
                counts.append(len(deps))
    edges = (
        idn[np.array(us, dtype=np.int64)],
        np.repeat(np.array(ws, dtype=np.int64), counts),
        np.array(kinds, dtype=bool),
    )
    return rows, table, held, edges
