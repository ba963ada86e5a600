"""BUILDMEMGRAPH (TURNIP section 6, Figures 8-9) for real, variably sized tensors on several GPUs.

A simulated execution of the TaskGraph in a serial order V. Two horizons move through V: the
allocation horizon is pushed greedily ahead of the execution horizon, giving future outputs their
arena range early (fewer constraints at run time). simMalloc takes a free range (oldest last use
first) and adds memory edges from the readers of what lay there. When the vertex to execute next
has no room, or an operand must come back, victims are evicted: the resident values whose next
use is furthest away (several at once for variable sizes: the window maximising the minimum
distance). A produced victim is offloaded (or just dropped when the host already holds a copy: a
graph input's own, or an earlier offload) and renamed to its reload for all later readers; an
allocated-but-unproduced future output is a victim too, at the distance of its own position, and
is *retracted* (its allocation undone, re-made later), which costs no transfer.

Vertices created while executing V[t] (offloads, reloads) sort just before V[t]; every edge then
points forward (section 7), so the MemGraph ids below are a topological order, which the runtime
uses as its priority. If the operands of one kernel fragment its arena so badly that no window
fits, the kernel is *compacted*: its output and operands are placed back to back from offset 0
(pre-checked to fit), evicting whatever lies there.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from typing import cast

from disco_ray.graph.errors import CapacityError, PlanError
from disco_ray.graph.memgraph import HOST, INPUT, Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .arena import Arena
from .capacity import capacities, log_rounding, rounded, vertex_needs
from .order import check_order, default_order
from .records import Inst, Rec

INF = float("inf")
_MKIND = {Kind.INPUT: MKind.INPUT, Kind.KERNEL: MKind.KERNEL, Kind.TRANSFER: MKind.TRANSFER}


class Planner:
    def __init__(
        self, tg: TaskGraph, capacity, order=None, alignment: int = 256, lookahead: int | None = None
    ):
        self.tg = tg
        self.V = tg.vertices  # id -> Vertex (the dict itself: the hot loops index it often)
        self.asked = capacities(capacity, tg.gpus)
        self.caps = rounded(self.asked, alignment)
        self.order = default_order(tg) if order is None else check_order(tg, order)
        self.lookahead = lookahead
        self.arenas = [Arena(c, alignment) for c in self.caps]
        self.hosts = [Arena(None, alignment) for _ in self.caps]
        self.pos = {vid: t for t, vid in enumerate(self.order)}
        self.recs: list[Rec] = []
        self.rec_of: dict[str, int] = {}  # TaskGraph vertex -> its Rec
        self.resident: dict[str, Inst] = {}
        self.host: dict[str, tuple[Loc, int | None]] = {}  # value -> (host copy, offload rec or None)
        self.host_readers: dict[str, list[int]] = {}
        self.uses: dict[str, list[int]] = {v: [] for v in self.order}
        for t, vid in enumerate(self.order):
            for i in dict.fromkeys(tg[vid].inputs):
                self.uses[i].append(t)
        self.next = dict.fromkeys(self.order, 0)  # index into uses[value] of the next unexecuted use
        self.outputs = set(tg.kept)  # outputs and carried values: kept in place at the end
        self.allocated = [False] * len(self.order)
        self.alloc_hzn = 0  # the allocation horizon (run() moves it)
        self.step = 0
        self.seq = 0
        self.nbytes = {v.id: v.nbytes for v in tg}
        self.operands = {v.id: list(dict.fromkeys(v.inputs)) for v in tg}
        self.sizes = {k: self.arenas[0].round(n) for k, n in self.nbytes.items()}
        self.counts = {
            "retractions": 0,
            "compactions": 0,
            "evictions": 0,
            "clean_evictions": 0,
            "superfluous_mem_edges": 0,
        }
        self._check_fits()

    # ---- checks -------------------------------------------------------------------------------
    def size(self, value: str) -> int:
        return self.sizes[value]

    def _check_fits(self) -> None:
        for v, g, need in vertex_needs(self.tg, self.arenas[0].align):
            cap = self.arenas[g].capacity
            assert cap is not None  # GPU arenas are bounded
            if need > cap:
                what = "its output" if v.kind is Kind.INPUT else "its inputs plus output"
                asked = self.asked[g]
                note = (
                    ""
                    if asked == cap
                    else f" ({asked} rounded down to the {self.arenas[g].align}-byte alignment)"
                )
                raise CapacityError(
                    f"vertex {v.id!r}: {what} need {need} bytes on gpu {g}, whose capacity is {cap} bytes{note}"
                )

    # ---- records and edges --------------------------------------------------------------------
    def _new(self, kind: MKind, value: str, gpu: int, key: tuple) -> int:
        self.recs.append(Rec(kind, value, gpu, key))
        return len(self.recs) - 1

    def _aux_key(self) -> tuple:
        self.seq += 1
        return (self.step, 0, self.seq)

    def _mem_edges(self, ghosts, w: int, alloc: bool) -> None:
        rec = self.recs[w]
        for _, _, _, readers in ghosts:
            for u in readers:
                if u == w:
                    continue
                if u in rec.deps:
                    self.counts["superfluous_mem_edges"] += 1  # already a dependency (paper Fig. 5, dashed)
                    continue
                rec.deps[u] = "mem"
                if alloc:
                    if rec.alloc_deps is None:
                        rec.alloc_deps = set()
                    rec.alloc_deps.add(u)

    # ---- victims --------------------------------------------------------------------------------
    def _next_use(self, value: str) -> float:
        uses, k = self.uses[value], self.next[value]
        return uses[k] if k < len(uses) else INF

    def _evict(self, inst: Inst, key: tuple | None = None) -> None:
        """Moves a produced value out of its arena (offloading it unless the host has a copy)."""
        if inst.value not in self.host and self.V[inst.value].kind is not Kind.INPUT:
            self.counts["evictions"] += 1
            host = self.hosts[inst.gpu]
            hoff = host.best_free(inst.size)
            assert hoff is not None  # a host store always has room
            o = self._new(MKind.OFFLOAD, inst.value, inst.gpu, key or self._aux_key())
            ghosts = host.take(hoff, inst.size, o)
            rec = self.recs[o]
            rec.ins = [(inst.value, inst.src, inst.loc)]
            rec.out = Loc(HOST, hoff, self.nbytes[inst.value])
            rec.deps[inst.src] = "data"
            self._mem_edges(ghosts, o, alloc=False)
            self.host[inst.value] = (rec.out, o)
            self.host_readers[inst.value] = []
            readers = (*inst.readers, o)
        else:
            self.counts["clean_evictions"] += 1
            readers = tuple(inst.readers) or (inst.src,)
        self.arenas[inst.gpu].release(inst.off, readers, self.step)
        del self.resident[inst.value]

    def _retract(self, inst: Inst) -> None:
        """Undoes the allocation of a future output; it is allocated again when the horizon returns."""
        self.counts["retractions"] += 1
        rec = self.recs[inst.src]
        for u in rec.alloc_deps or ():
            del rec.deps[u]
        rec.alloc_deps = None
        rec.out = None
        self.arenas[inst.gpu].release(inst.off, None, self.step)
        del self.resident[inst.value]
        self.allocated[inst.pos] = False
        self.alloc_hzn = min(self.alloc_hzn, inst.pos)

    def _make_room(
        self, gpu: int, size: int, pinned: Mapping[int, Inst], at: int | None = None
    ) -> int | None:
        """Evicts or retracts the best victims for `size` bytes on `gpu`; returns the freed offset."""
        arena = self.arenas[gpu]
        if at is None:
            off = arena.best_free(size)
            if off is not None:
                return off
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
    def _place_output(self, vid: str, off: int) -> Inst:
        v = self.V[vid]
        t = self.pos[vid]
        r = self.rec_of.get(vid)
        if r is None:
            r = self.rec_of[vid] = self._new(_MKIND[v.kind], vid, v.gpu, (t, 1, 0))
        size = self.sizes[vid]
        loc = Loc(v.gpu, off, self.nbytes[vid])
        inst = Inst(vid, v.gpu, r, loc, size, t, t)
        ghosts = self.arenas[v.gpu].take(off, size, inst)
        self.recs[r].out = loc
        self._mem_edges(ghosts, r, alloc=True)
        self.resident[vid] = inst
        self.allocated[self.pos[vid]] = True
        return inst

    def _reload(self, value: str, off: int) -> Inst:
        gpu = self.V[value].gpu
        loc, src = self.host[value] if value in self.host else (Loc(INPUT, 0, self.nbytes[value]), None)
        r = self._new(MKind.RELOAD, value, gpu, self._aux_key())
        size = self.sizes[value]
        out = Loc(gpu, off, self.nbytes[value])
        inst = Inst(value, gpu, r, out, size, self.pos[value], self._next_use(value))
        inst.produced = True
        ghosts = self.arenas[gpu].take(off, size, inst)
        rec = self.recs[r]
        rec.ins = [(value, src, loc)]
        rec.out = out
        if src is not None:
            rec.deps[src] = "data"
            self.host_readers[value].append(r)
        self._mem_edges(ghosts, r, alloc=False)
        self.resident[value] = inst
        return inst

    def _compact(self, vid: str, gpu: int) -> None:
        """Places vid's output and operands on `gpu` back to back from offset 0 (last resort)."""
        self.counts["compactions"] += 1
        v = self.V[vid]
        for i in dict.fromkeys(v.inputs):
            inst = self.resident.get(i)
            if inst is not None and inst.gpu == gpu:
                self._evict(inst)
        own = self.resident.get(vid)
        if own is not None and v.gpu == gpu:
            self._retract(own)
        pinned: dict[int, Inst] = {}
        cursor = 0
        items = [vid] if v.gpu == gpu else []
        for item in items + [i for i in dict.fromkeys(v.inputs) if self.V[i].gpu == gpu]:
            size = self.size(item)
            off = self._make_room(gpu, size, pinned, at=cursor)
            assert off == cursor, (vid, item, off, cursor)
            inst = self._place_output(item, off) if item == vid else self._reload(item, off)
            pinned[id(inst)] = inst
            cursor += size

    # ---- the two horizons -----------------------------------------------------------------------
    def _pinned_for(self, vid: str) -> dict[int, Inst]:
        v = self.V[vid]
        return {id(i): i for x in (vid, *v.inputs) if (i := self.resident.get(x)) is not None}

    def _execute(self, t: int, compacted: bool = False) -> None:
        vid = self.order[t]
        v = self.V[vid]
        r = self.rec_of[vid]
        rec = self.recs[r]
        operands = self.operands[vid]
        resident = self.resident
        for x in operands:  # reload every missing operand before anything is freed
            if x not in resident:
                pinned = self._pinned_for(vid)
                gpu = self.V[x].gpu
                off = self._make_room(gpu, self.size(x), pinned)
                if off is None:
                    if compacted:
                        raise PlanError(
                            f"vertex {vid!r}: no room for operand {x!r} on gpu {gpu} after compaction"
                        )
                    self._compact(vid, gpu)
                    return self._execute(t, compacted=True)
                self._reload(x, off)
        deps = rec.deps
        for x in operands:
            inst = resident[x]
            src = inst.src
            if deps.get(src) == "mem":
                self.counts["superfluous_mem_edges"] += 1
                alloc_deps = rec.alloc_deps
                assert alloc_deps is not None  # a mem dep exists only if it came from an allocation
                alloc_deps.discard(src)
            deps[src] = "data"
            inst.readers.append(r)
        rec.ins = [(x, resident[x].src, resident[x].loc) for x in v.inputs]
        own = resident[vid]
        own.produced = True
        own.dist = self._next_use(vid)
        nxt, uses = self.next, self.uses
        for x in operands:
            k = nxt[x] = nxt[x] + 1
            if k < len(uses[x]):
                resident[x].dist = uses[x][k]
            elif x in self.outputs:
                resident[x].dist = INF
            else:
                self._free(x)
        if not self.uses[vid] and vid not in self.outputs:
            self._free(vid)

    def _free(self, value: str) -> None:
        """simFree: the value is dead; its GPU range and any host copy become reusable."""
        inst = self.resident.pop(value)
        self.arenas[inst.gpu].release(inst.off, tuple(inst.readers) or (inst.src,), self.step)
        if value in self.host and self.host[value][1] is not None:
            loc, o = self.host.pop(value)
            assert o is not None  # checked above
            self.hosts[inst.gpu].release(loc.offset, tuple(self.host_readers.pop(value)) or (o,), self.step)

    def run(self) -> None:
        n = len(self.order)
        self.alloc_hzn = 0
        ex = 0
        failed = (-1, -1)  # (horizon, releases of its arena) of the last failed simMalloc
        while ex < n:
            self.step = ex
            while self.alloc_hzn < n and self.allocated[self.alloc_hzn]:
                self.alloc_hzn += 1
            a = self.alloc_hzn
            if a < n and (self.lookahead is None or a - ex <= self.lookahead):
                arena = self.arenas[self.V[self.order[a]].gpu]
                if failed != (a, arena.releases):
                    off = arena.best_free(self.size(self.order[a]))
                    if off is not None:
                        self._place_output(self.order[a], off)
                        continue
                    failed = (a, arena.releases)
            if not self.allocated[ex]:  # the vertex to execute next has no room: evict for it
                vid = self.order[ex]
                off = self._make_room(self.V[vid].gpu, self.size(vid), self._pinned_for(vid))
                if off is None:
                    self._compact(vid, self.V[vid].gpu)
                else:
                    self._place_output(vid, off)
                continue
            self._execute(ex)
            ex += 1
        self.step = n
        for o in self.tg.kept:  # an evicted output still in the caller's own copy comes back
            if o not in self.resident and self.host.get(o, (None, None))[1] is None:
                gpu = self.V[o].gpu
                off = self._make_room(gpu, self.size(o), {id(i): i for i in self.resident.values()})
                if off is None:
                    raise CapacityError(f"output {o!r}: no room on gpu {gpu} to keep it at the end")
                self._reload(o, off)

    # ---- result ---------------------------------------------------------------------------------
    def memgraph(self, started: float) -> MemGraph:
        recs = self.recs
        live = [i for i, rec in enumerate(recs) if rec.out is not None]
        live.sort(key=lambda i: recs[i].key)
        new_id = {old: new for new, old in enumerate(live)}
        verts = []
        edges: list[tuple[int, int, str]] = []
        for new, old in enumerate(live):
            rec = recs[old]
            ins = tuple(Read(val, None if src is None else new_id[src], loc) for val, src, loc in rec.ins)
            out = rec.out
            assert out is not None  # live
            verts.append(MemVertex(new, rec.kind, rec.value, rec.gpu, ins, out))
            edges += [(new_id[u], new, kind) for u, kind in rec.deps.items()]
        bad = next((e for e in edges if e[0] >= e[1]), None)
        if bad is not None:  # section 7: every edge points forward in V
            raise PlanError(f"internal: edge {bad[0]} -> {bad[1]} points backward")
        outputs = {}
        for o in self.tg.kept:
            inst = self.resident.get(o)
            if inst is not None:
                outputs[o] = new_id[inst.src]
            else:
                off_rec = self.host[o][1]
                assert off_rec is not None  # run() brought back every output the host holds no offload of
                outputs[o] = new_id[off_rec]
        moved = {k: 0 for k in ("offload", "reload")}
        for v in verts:
            if v.kind in (MKind.OFFLOAD, MKind.RELOAD):
                moved[v.kind.value] += v.out.nbytes
        stats = {
            "planning_seconds": round(time.perf_counter() - started, 4),
            "bytes_offloaded": moved["offload"],
            "bytes_reloaded": moved["reload"],
            "peak_gpu_bytes": [a.peak for a in self.arenas],
            "peak_host_bytes": [h.peak for h in self.hosts],
            **self.counts,
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
) -> MemGraph:
    """Compiles a TaskGraph into a MemGraph for GPUs of the given arena capacities.

    Args:
        tg: the TaskGraph.
        capacity: arena bytes, one int for every GPU or a list/dict per GPU.
        order: the serial order V (a topological order of all vertex ids); default: `default_order`.
        alignment: every range starts and is sized at a multiple of this many bytes.
        lookahead: how many vertices the allocation horizon may run ahead (None: unbounded).

    Raises:
        CapacityError: a vertex's inputs plus output do not fit its GPU.
        GraphError: a bad order or capacity.
    """
    started = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # the simulation makes millions of small acyclic objects: cyclic GC passes only cost
    try:
        p = Planner(tg, capacity, order, alignment, lookahead)
        p.run()
        mg = p.memgraph(started)
        log_rounding(p.asked, p.caps, alignment)
    finally:
        if collecting:
            gc.enable()
    mg.stats["order"] = "given" if order is not None else "default (depth-first from outputs)"
    return mg
