"""The simulated memory of BUILDMEMGRAPH (TURNIP section 6): arenas, records, resident values,
and the moves on them that planner.simulation chooses.

A value is given a range (simMalloc, Figure 8: `_place_output`), read, and released after its last
read (simFree: `_free`); taking a range adds memory edges from the readers of what lay there
(planner.arena keeps them as ghosts). A produced value that must leave its arena is offloaded, or
just dropped when the host already holds a copy (a graph input's own, or an earlier offload), and
comes back by a reload that later readers read instead (`_evict`, `_reload`); an output reserved
ahead and not computed yet is *retracted* (`_retract`: the allocation undone, its memory deps with
it, to be made again when its GPU's allocation horizon returns).

Memory tiers: each GPU's host store is an Arena, unbounded or of a budget (`host_capacity`); an
offload that finds no free range of the budget goes to that GPU's spill file instead (an
unbounded Arena of DISK_ALIGN-aligned ranges, so that the worker reads and writes it with
O_DIRECT), with the same range rules and memory edges; once host ranges free up, later offloads
go to the host again. Rejected: moving host residents down to disk to make room (a host-to-disk
vertex kind of its own) - a full host store simply sends the newer victims down.

The steps simulated are V's (planner.order), indexed once: per step the value it produces, per
value the steps that read it, per GPU the steps that allocate on it. The units refine the steps
(`_needs`, `_serial`, `_index`: planner.sum_into adds the members of an accumulate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from disco_ray.graph.memgraph import DISK, HOST, INPUT, Loc, MKind
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .arena import RESERVED, Arena, Block
from .capacity import aligned, capacities, host_capacities, rounded
from .conditions import after_flags
from .dense import Dense, check_fits, check_order
from .order import default
from .records import DATA, MEM, OWN, STEP, Inst, Rec

OWN_BIT = 1 << OWN
INF = float("inf")
FIT = "oldest"  # the default free-range choice (planner.arena), by simulated makespan
DISK_ALIGN = 4096  # spill-file ranges: O_DIRECT's alignment of offsets and sizes (actors/tiers/diskio.py)
_MKIND = {Kind.INPUT: MKind.INPUT, Kind.KERNEL: MKind.KERNEL, Kind.TRANSFER: MKind.TRANSFER}


class State:
    """The arenas (GPU, host store, spill file per GPU), the records of the MemGraph being built,
    the resident values and the index of V's steps. `counts` and the arenas' peaks are its
    statistics."""

    def __init__(
        self,
        tg: TaskGraph,
        capacity,
        order: Sequence[str] | None = None,
        alignment: int = 256,
        lookahead: int | None = None,
        fit: str = FIT,
        dense: Dense | None = None,
        host_capacity=None,
    ):
        d = self.d = dense if dense is not None else Dense(tg)
        self.tg = tg
        self.asked = capacities(capacity, tg.gpus)
        self.caps = rounded(self.asked, alignment)
        n = len(d)
        self.sizes = d.sizes(alignment)
        self.mkind = [_MKIND[x] for x in d.kind]
        self.arenas = [Arena(c, alignment, fit) for c in self.caps]
        self.host_asked = host_capacities(host_capacity, tg.gpus)
        self.hosts = [Arena(h, alignment) for h in self.host_asked]
        self.disks = [Arena(None, DISK_ALIGN) for _ in self.caps]
        check_fits(d, self._needs(), [cast(int, a.capacity) for a in self.arenas], self.asked, alignment)
        if order is None:
            seq, self.order_name = default(d, self.caps, alignment)
        else:
            seq, self.order_name = [d.index[x] for x in check_order(tg, order)], "given"
        if tg.conditional:  # a conditional vertex after its flags' writers (planner.conditions)
            seq = after_flags(d, tg, seq)
        self.seq = self._serial(seq)
        # per step: the value whose range it allocates (-1: none, a sum-into member after the first)
        self.alloc_of = list(self.seq)
        self.pos = [0] * n  # value -> the step that produces it
        self.uses: list[list[int]] = [[] for _ in range(n)]  # per value: positions of its readers
        self._index()
        self.lookahead = lookahead
        self.open: dict[int, Inst] = {}  # ranges held in place across steps (open sum-into groups)
        self.next = [0] * n  # index into uses[value] of the next unexecuted use
        self.kept = set(d.kept)  # outputs and carried values: kept in place at the end
        self.resident: list[Inst | None] = [None] * n
        self.allocated = bytearray(n)  # per value: its output has a range (allocated or produced)
        self.recs: list[Rec] = []
        self.rec_of = [-1] * n  # value -> its own Rec
        self.host: dict[int, tuple[Loc, int | None]] = {}  # value -> (host copy, offload rec or None)
        self.host_readers: dict[int, list[int]] = {}
        self.host_block: dict[int, Block] = {}  # value -> its offload's host or disk block
        self.mine, self.slot = self._horizons()
        self.hzn = [0] * tg.gpus
        self.failed = [-1] * tg.gpus  # arena.releases when its horizon last failed to allocate
        self.wake = set(range(tg.gpus))  # GPUs whose arena released a range since their horizon stopped
        self.step = 0
        self.aux = 0  # the last aux key's low bits; parts of a split plan number theirs apart
        self.stride = 1
        self.built = 0  # memory edges in the records (before the implied ones are dropped)
        self.locs: dict[tuple[int, int, int], Loc] = {}
        self.gpus: list[int] = list(range(tg.gpus))  # the GPUs simulated here
        self.counts = {
            "retractions": 0,
            "compactions": 0,
            "evictions": 0,
            "clean_evictions": 0,
            "superfluous_mem_edges": 0,
        }

    # ---- the steps, as the units refine them --------------------------------------------------
    def _needs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(value, gpu, bytes) of what each vertex needs at once (planner.dense.Dense.needs)."""
        return self.d.needs(self.sizes)

    def _serial(self, seq: list[int]) -> list[int]:
        """The steps simulated, from the serial order V (a unit may add steps of its own)."""
        return seq

    def _index(self) -> None:
        """Per step the value it produces (`pos`), per value the steps that read it (`uses`)."""
        pos, uses, operands = self.pos, self.uses, self.d.operands
        for t, k in enumerate(self.seq):
            for i in operands[k]:
                uses[i].append(t)
            pos[k] = t

    def _horizons(self) -> tuple[list[list[int]], list[int]]:
        """Per GPU the steps that allocate on it, in order; per value its index there."""
        at = np.asarray(self.alloc_of, dtype=np.int64)
        steps = np.flatnonzero(at >= 0)
        gs = np.asarray(self.d.gpu, dtype=np.int64)[at[steps]] if len(steps) else steps
        slot = np.zeros(len(self.d), dtype=np.int64)
        mine = []
        for g in range(self.tg.gpus):
            own = steps[gs == g]
            mine.append(own.tolist())
            slot[at[own]] = np.arange(len(own))
        return mine, slot.tolist()

    # ---- records and edges --------------------------------------------------------------------
    def _new(self, kind: MKind, value: int, gpu: int, key: int) -> int:
        self.recs.append(Rec(kind, value, gpu, key))
        return len(self.recs) - 1

    def _aux_key(self) -> int:
        self.aux += self.stride
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

    def _data_deps(self, deps: dict[int, bool], srcs: Sequence[int]) -> None:
        for src in srcs:
            if deps.get(src) is MEM:
                self.counts["superfluous_mem_edges"] += 1
                self.built -= 1
            deps[src] = DATA

    # ---- simMalloc, reads, simFree --------------------------------------------------------------
    def _place_output(self, k: int, off: int, blk: Block | None = None) -> Inst:
        g = self.d.gpu[k]
        t = self.pos[k]
        r = self.rec_of[k]
        if r < 0:
            recs = self.recs
            r = self.rec_of[k] = len(recs)
            rec = Rec(self.mkind[k], k, g, (t << STEP) | OWN_BIT)
            recs.append(rec)
        else:
            rec = self.recs[r]  # allocated again after a retraction (which cleared its deps)
        size = self.sizes[k]
        key = (g, off, self.d.nbytes[k])
        loc = self.locs.get(key)
        if loc is None:
            loc = self.locs[key] = Loc(*key)  # ranges recur: one Loc each
        inst = Inst(k, g, r, loc, size, t, RESERVED + t)
        arena = self.arenas[g]
        inst.block, ghosts = arena.take(blk if blk is not None else arena.block_at(off), off, size, inst)
        rec.out = loc
        if ghosts:
            if len(ghosts) == 1 and not rec.deps:  # the usual case: no deps yet, r read nothing
                readers = ghosts[0][3]
                deps = rec.deps = dict.fromkeys(readers, MEM)
                self.built += len(deps)
                if len(readers) > len(deps):
                    self.counts["superfluous_mem_edges"] += len(readers) - len(deps)
            else:
                self._mem_edges(ghosts, r)
        self.resident[k] = inst
        self.allocated[k] = 1
        return inst

    def _next_use(self, k: int) -> float:
        uses, i = self.uses[k], self.next[k]
        return uses[i] if i < len(uses) else INF

    def _read(self, x: int, inst: Inst) -> None:
        """Value x was read once more: its next use, or simFree after its last."""
        uses = self.uses[x]
        j = self.next[x] = self.next[x] + 1
        if j < len(uses):
            inst.dist = uses[j]
        elif x in self.kept:
            inst.dist = INF
        else:
            self._free(x)

    def _free(self, k: int) -> None:
        """simFree: the value is dead; its GPU range and any host copy become reusable."""
        inst = cast(Inst, self.resident[k])
        self.resident[k] = None
        readers = tuple(inst.readers) or tuple(inst.writers or (inst.src,))
        self.arenas[inst.gpu].release(cast(Block, inst.block), readers, self.step)
        self.wake.add(inst.gpu)
        if k in self.host:
            self._free_host(k, inst.gpu)

    def _free_host(self, k: int, gpu: int) -> None:
        """The host or disk copy of dead value k is reusable (a graph input's own copy stays)."""
        if self.host[k][1] is not None:
            loc, o = self.host.pop(k)
            assert o is not None  # checked above
            readers = tuple(self.host_readers.pop(k)) or (o,)
            store = self.disks[gpu] if loc.device == DISK else self.hosts[gpu]
            store.release(self.host_block.pop(k), readers, self.step)

    # ---- leaving the arena and coming back ------------------------------------------------------
    def _evict(self, inst: Inst) -> None:
        """Moves a produced value out of its arena (offloading it unless the host has a copy)."""
        k = inst.value
        if k not in self.host and self.d.kind[k] is not Kind.INPUT:
            self.counts["evictions"] += 1
            tier, store, size = HOST, self.hosts[inst.gpu], inst.size
            spot = store.best_free(size)
            if spot is None:  # the host budget is full: to the spill file
                tier, store, size = DISK, self.disks[inst.gpu], aligned(self.d.nbytes[k], DISK_ALIGN)
                spot = store.best_free(size)
                assert spot is not None  # a spill file always has room
            hblk, hoff = spot
            o = self._new(MKind.OFFLOAD, k, inst.gpu, self._aux_key())
            self.host_block[k], ghosts = store.take(hblk, hoff, size, o)
            rec = self.recs[o]
            rec.ins = [inst]
            rec.out = Loc(tier, hoff, self.d.nbytes[k])
            for w in inst.writers or (inst.src,):
                rec.deps[w] = DATA
            self._mem_edges(ghosts, o)
            self.host[k] = (rec.out, o)
            self.host_readers[k] = []
            readers: tuple[int, ...] = (*inst.readers, o)
        else:
            self.counts["clean_evictions"] += 1
            readers = tuple(inst.readers) or tuple(inst.writers or (inst.src,))
        self.arenas[inst.gpu].release(cast(Block, inst.block), readers, self.step)
        self.wake.add(inst.gpu)
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
        self.wake.add(g)
        k = inst.value
        self.resident[k] = None
        self.allocated[k] = 0
        if self.slot[k] < self.hzn[g]:
            self.hzn[g] = self.slot[k]

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

    def close(self) -> None:
        """Frees the simulation (its numbered Part keeps what the MemGraph needs). Breaks its
        reference cycles (arena blocks <-> neighbours and owners) and drops its records and
        residents now: a split plan frees them while the other parts send theirs."""
        for arena in (*self.arenas, *self.hosts, *self.disks):
            arena.clear()
        self.recs, self.resident, self.uses, self.locs = [], [], [], {}
        self.host, self.host_readers, self.host_block = {}, {}, {}

    def aux_keys(self) -> list[int]:
        """The sort keys of this simulation's offloads and reloads (the records not of V itself)."""
        return [r.key for r in self.recs if r.out is not None and not r.key & OWN_BIT]
