"""BUILDMEMGRAPH (TURNIP section 6, Figures 8-9) for real, variably sized tensors on several GPUs.

A simulated execution of the TaskGraph in a serial order V (planner.order). Two horizons move
through V: the allocation horizon is pushed greedily ahead of the execution horizon, giving future
outputs their arena range early (fewer constraints at run time). There is one allocation horizon
per GPU, over that GPU's vertices, so a full arena does not hold the others back. simMalloc takes
a free range (planner.arena) and adds memory edges from the readers of what lay there.

When the vertex to execute next has no room, or an operand must come back, victims are chosen by
key (planner.arena.best_window): outputs reserved ahead and not computed yet are *retracted* first
(the allocation undone, to be made again when the horizon returns: no transfer), then a kept value
nobody reads again, then live values by furthest next use. With one tensor size this reloads
exactly what Belady's MIN does for V (planner.bounds; tests/test_belady.py); ranking a reservation
by its own position instead (the former rule) evicted live data that was needed sooner. A produced
victim is offloaded (or just dropped when the host already holds a copy: a graph input's own, or
an earlier offload) and renamed to its reload for all later readers.

Vertices created while executing V[t] (offloads, reloads) sort just before V[t]; every edge then
points forward (section 7), so the MemGraph ids below are a topological order, which the runtime
uses as its priority. Memory edges implied by other paths are dropped at the end (planner.prune).
If the operands of one kernel fragment its arena so badly that no window fits, the kernel is
*compacted*: its output and operands are placed back to back from offset 0 (pre-checked to fit),
evicting whatever lies there.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np

from disco_ray.graph.errors import CapacityError, PlanError
from disco_ray.graph.memgraph import HOST, INPUT, Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .arena import RESERVED, Arena, Block
from .capacity import capacities, log_rounding, rounded
from .dense import Dense, check_order
from .order import default
from .prune import WINDOW, Reducer
from .records import DATA, MEM, OWN, STEP, Inst, Rec

INF = float("inf")
FIT = "oldest"  # the default free-range choice (planner.arena), by simulated makespan
_MKIND = {Kind.INPUT: MKind.INPUT, Kind.KERNEL: MKind.KERNEL, Kind.TRANSFER: MKind.TRANSFER}


class Planner:
    def __init__(
        self,
        tg: TaskGraph,
        capacity,
        order: Sequence[str] | None = None,
        alignment: int = 256,
        lookahead: int | None = None,
        fit: str = FIT,
        dense: Dense | None = None,
    ):
        d = self.d = dense if dense is not None else Dense(tg)
        self.tg = tg
        self.asked = capacities(capacity, tg.gpus)
        self.caps = rounded(self.asked, alignment)
        n = len(d)
        self.sizes = d.sizes(alignment)
        self.arenas = [Arena(c, alignment, fit) for c in self.caps]
        self.hosts = [Arena(None, alignment) for _ in self.caps]
        self._check_fits()
        if order is None:
            self.seq, self.order_name = default(d, self.caps, alignment)
        else:
            self.seq, self.order_name = [d.index[x] for x in check_order(tg, order)], "given"
        seq = self.seq
        self.pos = pos = [0] * n
        for t, k in enumerate(seq):
            pos[k] = t
        self.lookahead = lookahead
        operands = d.operands
        self.uses: list[list[int]] = [[] for _ in range(n)]  # per value: positions of its readers
        uses = self.uses
        for t, k in enumerate(seq):
            for i in operands[k]:
                uses[i].append(t)
        self.next = [0] * n  # index into uses[value] of the next unexecuted use
        self.kept = set(d.kept)  # outputs and carried values: kept in place at the end
        self.resident: list[Inst | None] = [None] * n
        self.allocated = bytearray(n)  # per value: its output has a range (allocated or produced)
        self.recs: list[Rec] = []
        self.rec_of = [-1] * n  # value -> its own Rec
        self.host: dict[int, tuple[Loc, int | None]] = {}  # value -> (host copy, offload rec or None)
        self.host_readers: dict[int, list[int]] = {}
        self.host_block: dict[int, Block] = {}  # value -> its offload's host block
        # one allocation horizon per GPU over its own vertices
        self.mine: list[list[int]] = [[] for _ in self.caps]
        self.slot = [0] * n  # value -> its index in mine[its gpu]
        gpu = d.gpu
        for t, k in enumerate(seq):
            m = self.mine[gpu[k]]
            self.slot[k] = len(m)
            m.append(t)
        self.hzn = [0] * tg.gpus
        self.failed = [-1] * tg.gpus  # arena.releases when its horizon last failed to allocate
        self.step = 0
        self.aux = 0
        self.built = 0  # memory edges in the records (before the implied ones are dropped)
        self.locs: dict[tuple[int, int, int], Loc] = {}
        self.counts = {
            "retractions": 0,
            "compactions": 0,
            "evictions": 0,
            "clean_evictions": 0,
            "superfluous_mem_edges": 0,
        }

    # ---- checks -------------------------------------------------------------------------------
    def _check_fits(self) -> None:
        d = self.d
        ks, gs, need = d.needs(self.sizes)
        room = np.array([cast(int, a.capacity) for a in self.arenas], dtype=np.int64)
        bad = np.flatnonzero(need > room[gs])
        if len(bad):
            i = int(bad[np.argmin(ks[bad])])  # the first vertex in list order
            k, g = int(ks[i]), int(gs[i])
            what = "its output" if d.kind[k] is Kind.INPUT else "its inputs plus output"
            asked, cap = self.asked[g], int(room[g])
            note = (
                ""
                if asked == cap
                else f" ({asked} rounded down to the {self.arenas[g].align}-byte alignment)"
            )
            raise CapacityError(
                f"vertex {d.ids[k]!r}: {what} need {int(need[i])} bytes on gpu {g}, whose capacity is "
                f"{cap} bytes{note}"
            )

    # ---- records and edges --------------------------------------------------------------------
    def _new(self, kind: MKind, value: int, gpu: int, key: int) -> int:
        self.recs.append(Rec(kind, value, gpu, key))
        return len(self.recs) - 1

    def _aux_key(self) -> int:
        self.aux += 1
        return (self.step << STEP) | self.aux

    def _mem_edges(self, ghosts, w: int) -> None:
        deps = self.recs[w].deps
        before = len(deps)
        dup = 0
        for _, _, _, readers in ghosts:
            for u in readers:
                if u in deps:
                    dup += 1  # already a dependency (paper Fig. 5, dashed)
                elif u != w:
                    deps[u] = MEM
        self.built += len(deps) - before
        if dup:
            self.counts["superfluous_mem_edges"] += dup

    # ---- victims --------------------------------------------------------------------------------
    def _next_use(self, k: int) -> float:
        uses, i = self.uses[k], self.next[k]
        return uses[i] if i < len(uses) else INF

    def _evict(self, inst: Inst) -> None:
        """Moves a produced value out of its arena (offloading it unless the host has a copy)."""
        k = inst.value
        if k not in self.host and self.d.kind[k] is not Kind.INPUT:
            self.counts["evictions"] += 1
            host = self.hosts[inst.gpu]
            spot = host.best_free(inst.size)
            assert spot is not None  # a host store always has room
            hblk, hoff = spot
            o = self._new(MKind.OFFLOAD, k, inst.gpu, self._aux_key())
            self.host_block[k], ghosts = host.take(hblk, hoff, inst.size, o)
            rec = self.recs[o]
            rec.ins = [inst]
            rec.out = Loc(HOST, hoff, self.d.nbytes[k])
            rec.deps[inst.src] = DATA
            self._mem_edges(ghosts, o)
            self.host[k] = (rec.out, o)
            self.host_readers[k] = []
            readers: tuple[int, ...] = (*inst.readers, o)
        else:
            self.counts["clean_evictions"] += 1
            readers = tuple(inst.readers) or (inst.src,)
        self.arenas[inst.gpu].release(cast(Block, inst.block), readers, self.step)
        self.resident[k] = None

    def _retract(self, inst: Inst) -> None:
        """Undoes the allocation of a future output; it is allocated again when the horizon returns."""
        self.counts["retractions"] += 1
        rec = self.recs[inst.src]
        self.built -= len(rec.deps)
        rec.deps.clear()  # all memory deps of the allocation: it has not executed
        rec.out = None
        g = inst.gpu
        self.arenas[g].release(cast(Block, inst.block), None, self.step)
        k = inst.value
        self.resident[k] = None
        self.allocated[k] = 0
        if self.slot[k] < self.hzn[g]:
            self.hzn[g] = self.slot[k]

    def _make_room(
        self, gpu: int, size: int, pinned: Mapping[int, Inst], at: int | None = None
    ) -> int | None:
        """Retracts or evicts the best victims for `size` bytes on `gpu`; returns the freed offset."""
        arena = self.arenas[gpu]
        if at is None:
            spot = arena.best_free(size)
            if spot is not None:
                return spot[1]
        found = arena.best_window(size, pinned, at)
        if found is None:
            return None
        off, victims = found
        for b in victims:
            inst = cast(Inst, b.owner)  # a GPU arena's owners are Insts
            if inst.produced:
                self._evict(inst)
            else:
                self._retract(inst)
        return off

    # ---- placing values -------------------------------------------------------------------------
    def _place_output(self, k: int, off: int, blk: Block | None = None) -> Inst:
        d = self.d
        g = d.gpu[k]
        t = self.pos[k]
        r = self.rec_of[k]
        if r < 0:
            recs = self.recs
            r = self.rec_of[k] = len(recs)
            recs.append(Rec(_MKIND[d.kind[k]], k, g, (t << STEP) | (1 << OWN)))
        size = self.sizes[k]
        nb = d.nbytes[k]
        loc = self.locs.get((g, off, nb))
        if loc is None:
            loc = self.locs[(g, off, nb)] = Loc(g, off, nb)  # ranges recur: one Loc each
        inst = Inst(k, g, r, loc, size, t, RESERVED + t)
        arena = self.arenas[g]
        inst.block, ghosts = arena.take(blk if blk is not None else arena.block_at(off), off, size, inst)
        self.recs[r].out = loc
        if ghosts:
            self._mem_edges(ghosts, r)
        self.resident[k] = inst
        self.allocated[k] = 1
        return inst

    def _reload(self, k: int, off: int) -> Inst:
        d = self.d
        g = d.gpu[k]
        loc, src = self.host[k] if k in self.host else (Loc(INPUT, 0, d.nbytes[k]), None)
        r = self._new(MKind.RELOAD, k, g, self._aux_key())
        size = self.sizes[k]
        out = Loc(g, off, d.nbytes[k])
        inst = Inst(k, g, r, out, size, self.pos[k], self._next_use(k))
        inst.produced = True
        arena = self.arenas[g]
        inst.block, ghosts = arena.take(arena.block_at(off), off, size, inst)
        rec = self.recs[r]
        rec.ins = [(k, src, loc)]
        rec.out = out
        if src is not None:
            rec.deps[src] = DATA
            self.host_readers[k].append(r)
        self._mem_edges(ghosts, r)
        self.resident[k] = inst
        return inst

    def _compact(self, k: int, gpu: int) -> None:
        """Places k's output and operands on `gpu` back to back from offset 0 (last resort)."""
        self.counts["compactions"] += 1
        d = self.d
        ops = d.operands[k]
        for i in ops:
            inst = self.resident[i]
            if inst is not None and inst.gpu == gpu:
                if inst.produced:
                    self._evict(inst)
                else:
                    self._retract(inst)
        own = self.resident[k]
        if own is not None and d.gpu[k] == gpu:
            self._retract(own)
        pinned: dict[int, Inst] = {}
        cursor = 0
        items = [k] if d.gpu[k] == gpu else []
        for item in items + [i for i in ops if d.gpu[i] == gpu]:
            size = self.sizes[item]
            off = self._make_room(gpu, size, pinned, at=cursor)
            assert off == cursor, (d.ids[k], d.ids[item], off, cursor)
            inst = self._place_output(item, off) if item == k else self._reload(item, off)
            pinned[id(inst)] = inst
            cursor += size

    # ---- the two horizons -----------------------------------------------------------------------
    def _pinned_for(self, k: int) -> dict[int, Inst]:
        res = self.resident
        return {id(i): i for x in (k, *self.d.operands[k]) if (i := res[x]) is not None}

    def _advance(self, g: int, ex: int) -> None:
        """Pushes GPU g's allocation horizon as far as free ranges allow (simMalloc, Figure 8)."""
        arena = self.arenas[g]
        mine, seq, alloc, sizes = self.mine[g], self.seq, self.allocated, self.sizes
        la = self.lookahead
        i = self.hzn[g]
        while i < len(mine):
            t = mine[i]
            k = seq[t]
            if alloc[k]:
                i += 1
                continue
            if la is not None and t - ex > la:
                self.failed[g] = -1  # not a failure: try again at the next step
                break
            spot = arena.best_free(sizes[k])
            if spot is None:
                self.failed[g] = arena.releases
                break
            self._place_output(k, spot[1], spot[0])
            i += 1
        else:
            self.failed[g] = arena.releases  # the horizon is at the end: wait for a retraction
        self.hzn[g] = i

    def _execute(self, t: int, compacted: bool = False) -> None:
        d = self.d
        k = self.seq[t]
        rec = self.recs[self.rec_of[k]]
        operands = d.operands[k]
        resident = self.resident
        for x in operands:  # reload every missing operand before anything is freed
            if resident[x] is None:
                gpu = d.gpu[x]
                off = self._make_room(gpu, self.sizes[x], self._pinned_for(k))
                if off is None:
                    if compacted:
                        raise PlanError(
                            f"vertex {d.ids[k]!r}: no room for operand {d.ids[x]!r} on gpu {gpu} "
                            "after compaction"
                        )
                    self._compact(k, gpu)
                    return self._execute(t, compacted=True)
                self._reload(x, off)
        deps = rec.deps
        r = self.rec_of[k]
        res = cast("list[Inst]", resident)  # every operand is resident now
        rec.ins = [res[x] for x in d.inputs[k]]
        own = res[k]
        own.produced = True
        uses, nxt, kept = self.uses, self.next, self.kept
        uk = uses[k]
        own.dist = uk[0] if uk else INF
        for x in operands:
            inst = res[x]
            src = inst.src
            if deps.get(src) is MEM:
                self.counts["superfluous_mem_edges"] += 1
                self.built -= 1
            deps[src] = DATA
            inst.readers.append(r)
            j = nxt[x] = nxt[x] + 1
            ux = uses[x]
            if j < len(ux):
                inst.dist = ux[j]
            elif x in kept:
                inst.dist = INF
            else:
                self._free(x)
        if not uk and k not in kept:
            self._free(k)

    def _free(self, k: int) -> None:
        """simFree: the value is dead; its GPU range and any host copy become reusable."""
        inst = cast(Inst, self.resident[k])
        self.resident[k] = None
        self.arenas[inst.gpu].release(cast(Block, inst.block), tuple(inst.readers) or (inst.src,), self.step)
        if k in self.host and self.host[k][1] is not None:
            _, o = self.host.pop(k)
            assert o is not None  # checked above
            readers = tuple(self.host_readers.pop(k)) or (o,)
            self.hosts[inst.gpu].release(self.host_block.pop(k), readers, self.step)

    def run(self) -> None:
        d = self.d
        n = len(self.seq)
        gpus = range(len(self.caps))
        arenas, failed = self.arenas, self.failed
        for ex in range(n):
            self.step = ex
            for g in gpus:
                if failed[g] != arenas[g].releases:
                    self._advance(g, ex)
            k = self.seq[ex]
            if not self.allocated[k]:  # the vertex to execute next has no room: evict for it
                g = d.gpu[k]
                off = self._make_room(g, self.sizes[k], self._pinned_for(k))
                if off is None:
                    self._compact(k, g)
                else:
                    self._place_output(k, off)
            self._execute(ex)
        self.step = n
        for o in d.kept:  # an evicted output still in the caller's own copy comes back
            if self.resident[o] is None and self.host.get(o, (None, None))[1] is None:
                g = d.gpu[o]
                pinned = {id(i): i for i in self.resident if i is not None}
                off = self._make_room(g, self.sizes[o], pinned)
                if off is None:
                    raise CapacityError(f"output {d.ids[o]!r}: no room on gpu {g} to keep it at the end")
                self._reload(o, off)

    # ---- result ---------------------------------------------------------------------------------
    def memgraph(self, started: float, window: int = WINDOW) -> MemGraph:
        recs = self.recs
        ids = self.d.ids
        live = [i for i, rec in enumerate(recs) if rec.out is not None]
        live.sort(key=lambda i: recs[i].key)
        new_id = [-1] * len(recs)
        for new, old in enumerate(live):
            new_id[old] = new
        verts = []
        edges: list[tuple[int, int, str]] = []
        reducer = Reducer(window)
        for new, old in enumerate(live):
            rec = recs[old]
            reads = []
            for x in rec.ins:
                if type(x) is Inst:
                    rd = x.read
                    if rd is None:
                        rd = x.read = Read(ids[x.value], new_id[x.src], x.loc)
                    reads.append(rd)
                else:
                    val, src, loc = cast("tuple[int, int | None, Loc]", x)
                    reads.append(Read(ids[val], None if src is None else new_id[src], loc))
            out = rec.out
            assert out is not None  # live
            verts.append(MemVertex(new, rec.kind, ids[rec.value], rec.gpu, tuple(reads), out))
            try:  # section 7: every edge points forward in V
                reducer.add(new, rec.deps.items(), edges, new_id)
            except ValueError as e:
                raise PlanError(f"internal: {e}") from None
        implied = reducer.dropped
        outputs = {}
        for o in self.d.kept:
            inst = self.resident[o]
            if inst is not None:
                outputs[ids[o]] = new_id[inst.src]
            else:
                off_rec = self.host[o][1]
                assert off_rec is not None  # run() brought back every output the host holds no offload of
                outputs[ids[o]] = new_id[off_rec]
        moved = {MKind.OFFLOAD: 0, MKind.RELOAD: 0}
        for v in verts:
            if v.kind in moved:
                moved[v.kind] += v.out.nbytes
        counts = dict(self.counts)
        counts["superfluous_mem_edges"] += implied
        stats = {
            "planning_seconds": round(time.perf_counter() - started, 4),
            "bytes_offloaded": moved[MKind.OFFLOAD],
            "bytes_reloaded": moved[MKind.RELOAD],
            "peak_gpu_bytes": [a.peak for a in self.arenas],
            "peak_host_bytes": [h.peak for h in self.hosts],
            **counts,
            "implied_mem_edges": implied,
            "mem_edges_built": self.built,
        }
        host_cap = [h.top for h in self.hosts]
        return MemGraph(list(self.caps), verts, edges, outputs, host_cap, stats)


def build_memgraph(
    tg: TaskGraph,
    capacity: int | Sequence[int] | Mapping[int, int],
    *,
    order: Sequence[str] | None = None,
    alignment: int = 256,
    lookahead: int | None = None,
    fit: str = FIT,
    window: int = WINDOW,
) -> MemGraph:
    """Compiles a TaskGraph into a MemGraph for GPUs of the given arena capacities.

    Args:
        tg: the TaskGraph.
        capacity: arena bytes, one int for every GPU or a list/dict per GPU.
        order: the serial order V (a topological order of all vertex ids); default: the schedule
            order (`planner.order.default_order` for these capacities).
        alignment: every range starts and is sized at a multiple of this many bytes.
        lookahead: how many vertices the allocation horizon may run ahead (None: unbounded).
        fit: the free-range choice, "oldest" (last use furthest in the past) or "best" (tightest).
        window: ids within which implied memory edges are found and dropped (0: keep them all).

    Raises:
        CapacityError: a vertex's inputs plus output do not fit its GPU.
        GraphError: a bad order or capacity.
    """
    started = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # the simulation makes millions of small acyclic objects: cyclic GC passes only cost
    try:
        p = Planner(tg, capacity, order, alignment, lookahead, fit)
        p.run()
        mg = p.memgraph(started, window)
        log_rounding(p.asked, p.caps, alignment)
    finally:
        if collecting:
            gc.enable()
    mg.stats["order"] = p.order_name if order is not None else f"default ({p.order_name})"
    mg.stats["fit"] = fit
    mg._planned_for = id(tg)  # this process's own plan of tg: Program runs it unverified
    return mg
