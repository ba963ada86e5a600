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

Memory tiers: each GPU's host store is an Arena, unbounded or of a budget (`host_capacity`); an
offload that finds no free range of the budget goes to that GPU's spill file instead (an
unbounded Arena of DISK_ALIGN-aligned ranges, so that the worker reads and writes it with
O_DIRECT), with the same range rules and memory edges; once host ranges free up, later offloads
go to the host again. Rejected: moving host residents down to disk to make room (a host-to-disk
vertex kind of its own) - a full host store simply sends the newer victims down.

Vertices created while executing V[t] (offloads, reloads) sort just before V[t]; every edge then
points forward (section 7), so the MemGraph ids below are a topological order, which the runtime
uses as its priority. Memory edges implied by other paths are dropped at the end (planner.prune).
If the operands of one kernel fragment its arena so badly that no window fits, the kernel is
*compacted*: its output and operands are placed back to back from offset 0 (pre-checked to fit),
evicting whatever lies there.

Sum-into groups (TURNIP appendix A, planner.groups): an `accumulate` is simulated as one step per
operand, its members. The first allocates the sum's range (a reservation like any output); from
it to the last the range is pinned (no victim, no compaction moves it), since every member must
write the same bytes; each member gets the range's memory deps, and whatever reads, offloads or
overwrites the sum afterwards depends on all members (`Inst.writers`). Members get no edges
among themselves. A vertex that finds no room because of an open sum raises GroupError, and
build_memgraph plans again with that group demoted.

Parts (planner.split): apart from transfers the GPUs' simulations are independent given V, so a
large plan is simulated in parts, one forked process per group of GPUs (`workers`); a transfer
between parts is read in the part of its source and written in that of its destination. Each
part numbers its own vertices (`Planner.part`): a record's id is its step plus the offloads and
reloads of smaller key, so only those keys are swapped, and makes its own vertices and edges;
planner.export joins the parts into the MemGraph.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np

from disco_ray.graph.errors import CapacityError, DiscoError, PlanError
from disco_ray.graph.memgraph import (
    DISK,
    HOST,
    INPUT,
    Loc,
    MemGraph,
    MKind,
    new_read,
    new_vertex,
)
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .arena import RESERVED, Arena, Block
from .capacity import aligned, capacities, host_capacities, log_rounding, rounded
from .dense import Dense, check_order
from .export import export
from .groups import MODES, Members
from .order import default
from .prune import WINDOW
from .records import DATA, MEM, OWN, STEP, Inst, Part, Rec
from .split import groups, run_split

OWN_BIT = 1 << OWN
FULL, SKIP, SOURCE, DEST = 0, 1, 2, 3  # what a part of a split plan does at a step (Planner._codes)

log = logging.getLogger(__name__)
INF = float("inf")
FIT = "oldest"  # the default free-range choice (planner.arena), by simulated makespan
DISK_ALIGN = 4096  # spill-file ranges: O_DIRECT's alignment of offsets and sizes (actors/tiers/diskio.py)
_MKIND = {Kind.INPUT: MKind.INPUT, Kind.KERNEL: MKind.KERNEL, Kind.TRANSFER: MKind.TRANSFER}
SUM_INTO = "eager"  # how an `accumulate` is planned (planner.groups.MODES)
ROUNDS = 4  # plans made again with the blocking groups demoted before a mode is given up for all


class GroupError(PlanError):
    """An open sum-into group's range is in the way (it may not move between its members)."""

    def __init__(self, msg: str, groups: Sequence[int]):
        super().__init__(msg)
        self.groups = tuple(groups)  # the accumulates (positions) whose open sums were in the way

    def __reduce__(self):  # sent from a forked part (planner.split)
        return GroupError, (str(self), self.groups)


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
        sum_into: str = SUM_INTO,
        demoted: Mapping[int, str] | None = None,
        host_capacity=None,
    ):
        if sum_into not in MODES:
            raise ValueError(f"sum_into must be one of {MODES}, got {sum_into!r}")
        d = self.d = dense if dense is not None else Dense(tg)
        self.sum_into = sum_into
        self.demoted = dict(demoted or {})
        self.mem = mem = Members(d, self.demoted) if sum_into != "off" else None
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
        self._check_fits()
        if order is None:
            self.seq, self.order_name = default(d, self.caps, alignment)
        else:
            self.seq, self.order_name = [d.index[x] for x in check_order(tg, order)], "given"
        if mem is not None and len(mem):
            self.seq = mem.expand(self.seq, sum_into)
        seq = self.seq
        # per step: the value whose range it allocates (-1: none, a sum-into member after the first)
        self.alloc_of = alloc_of = list(seq)
        self.pos = pos = [0] * n
        operands = d.operands
        self.uses: list[list[int]] = [[] for _ in range(n)]  # per value: positions of its readers
        uses = self.uses
        for t, k in enumerate(seq):
            if k >= n:  # a member reads its operand and, unless it is the first, adds into the sum
                j = k - n
                k = alloc_of[t] = mem.acc[j]  # type: ignore[union-attr]
                uses[mem.x[j]].append(t)  # type: ignore[union-attr]
                if not mem.first[j]:  # type: ignore[union-attr]
                    uses[k].append(t)
                    alloc_of[t] = -1
                    continue
            else:
                for i in operands[k]:
                    uses[i].append(t)
            pos[k] = t
        self.lookahead = lookahead
        self.open: dict[int, Inst] = {}  # sum-into groups between their first and last member
        self.group_deps: dict[int, dict[int, bool]] = {}  # group -> memory deps of its range
        self.next = [0] * n  # index into uses[value] of the next unexecuted use
        self.kept = set(d.kept)  # outputs and carried values: kept in place at the end
        self.resident: list[Inst | None] = [None] * n
        self.allocated = bytearray(n)  # per value: its output has a range (allocated or produced)
        self.recs: list[Rec] = []
        self.rec_of = [-1] * n  # value -> its own Rec
        self.host: dict[int, tuple[Loc, int | None]] = {}  # value -> (host copy, offload rec or None)
        self.host_readers: dict[int, list[int]] = {}
        self.host_block: dict[int, Block] = {}  # value -> its offload's host or disk block
        # one allocation horizon per GPU over its own vertices
        self.mine: list[list[int]] = []  # per GPU: the steps that allocate on it, in order
        self.slot = [0] * n  # value -> its index in mine[its gpu]
        at = np.asarray(alloc_of, dtype=np.int64)
        steps = np.flatnonzero(at >= 0)
        gs = np.asarray(d.gpu, dtype=np.int64)[at[steps]] if len(steps) else steps
        slot = np.zeros(n, dtype=np.int64)
        for g in range(tg.gpus):
            mine = steps[gs == g]
            self.mine.append(mine.tolist())
            slot[at[mine]] = np.arange(len(mine))
        self.slot = slot.tolist()
        self.hzn = [0] * tg.gpus
        self.failed = [-1] * tg.gpus  # arena.releases when its horizon last failed to allocate
        self.wake = set(range(tg.gpus))  # GPUs whose arena released a range since their horizon stopped
        self.step = 0
        self.aux = 0  # the last aux key's low bits; parts of a split plan number theirs apart
        self.stride = 1
        self.built = 0  # memory edges in the records (before the implied ones are dropped)
        self.locs: dict[tuple[int, int, int], Loc] = {}
        # a part of a split plan (planner.split) holds only some GPUs; a transfer between two parts
        # is executed in both: the source's part reads (xreads), the destination's part writes it
        self.gpus: list[int] = list(range(tg.gpus))  # the GPUs simulated here
        self.pending: dict[int, int] = {}  # transfer -> its record, whose read another part makes
        self.xreads: list[tuple[int, int, int, tuple[int, ...] | None, Loc]] = []
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
        if self.mem is not None and self.mem.of:  # a member needs the sum and one operand at once
            sizes = self.sizes
            need = need.copy()
            nt = 2 * len(d) - len(ks)  # the rows of non-transfers come first, by position
            for k, ms in self.mem.of.items():
                i = int(np.searchsorted(ks[:nt], k))
                need[i] = sizes[k] + max(sizes[self.mem.x[m]] for m in ms)
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

    # ---- victims --------------------------------------------------------------------------------
    def _next_use(self, k: int) -> float:
        uses, i = self.uses[k], self.next[k]
        return uses[i] if i < len(uses) else INF

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

    def _compact(self, k: int, gpu: int, ops: Sequence[int] | None = None) -> None:
        """Places k's output and operands (`ops`, default k's own) on `gpu` back to back from
        offset 0 (last resort)."""
        self.counts["compactions"] += 1
        d = self.d
        if ops is None:
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
        pinned: dict[int, Inst] = dict(self.open)
        cursor = 0
        items = [k] if d.gpu[k] == gpu else []
        for item in items + [i for i in ops if d.gpu[i] == gpu]:
            size = self.sizes[item]
            off = self._make_room(gpu, size, pinned, at=cursor)
            if off is None and self.open:
                raise GroupError(
                    f"vertex {d.ids[k]!r}: an open sum-into range blocks compaction on gpu {gpu}",
                    [i.value for i in self.open.values()],
                )
            assert off == cursor, (d.ids[k], d.ids[item], off, cursor)
            inst = self._place_output(item, off) if item == k else self._reload(item, off)
            pinned[id(inst)] = inst
            cursor += size

    # ---- the two horizons -----------------------------------------------------------------------
    def _pinned_for(self, k: int) -> dict[int, Inst]:
        res = self.resident
        pinned = {id(i): i for x in (k, *self.d.operands[k]) if (i := res[x]) is not None}
        if self.open:
            pinned.update(self.open)
        return pinned

    def _advance(self, g: int, ex: int) -> None:
        """Pushes GPU g's allocation horizon as far as free ranges allow (simMalloc, Figure 8)."""
        arena = self.arenas[g]
        mine, seq, alloc, sizes = self.mine[g], self.alloc_of, self.allocated, self.sizes
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
            if resident[x] is None and not self._bring(k, x, compacted):
                return self._execute(t, compacted=True)
        deps = rec.deps
        r = self.rec_of[k]
        res: list[Inst] = resident  # type: ignore[assignment]  # every operand is resident now
        ins = d.inputs[k]
        if ins:
            rec.ins = [res[x] for x in ins]
        own = res[k]
        own.produced = True
        uses, nxt, kept = self.uses, self.next, self.kept
        uk = uses[k]
        own.dist = uk[0] if uk else INF
        for x in operands:
            inst = res[x]
            if inst.writers is None:
                src = inst.src
                if deps.setdefault(src, DATA) is MEM:
                    self.counts["superfluous_mem_edges"] += 1
                    self.built -= 1
                    deps[src] = DATA
            else:
                self._data_deps(deps, inst.writers)
            readers = inst.readers
            readers.append(r)
            j = nxt[x] = nxt[x] + 1
            ux = uses[x]
            if j < len(ux):
                inst.dist = ux[j]
            elif x in kept:
                inst.dist = INF
            else:  # simFree (the usual case of _free, inline): x is dead after this read
                resident[x] = None
                g = inst.gpu
                self.arenas[g].release(inst.block, tuple(readers), self.step)  # type: ignore[arg-type]
                self.wake.add(g)
                if x in self.host:
                    self._free_host(x, g)
        if not uk and k not in kept:
            self._free(k)

    def _bring(self, k: int, x: int, compacted: bool) -> bool:
        """Reloads operand x of vertex k; False when that took a compaction (k starts over)."""
        d = self.d
        gpu = d.gpu[x]
        off = self._make_room(gpu, self.sizes[x], self._pinned_for(k))
        if off is None:
            if compacted:
                raise PlanError(
                    f"vertex {d.ids[k]!r}: no room for operand {d.ids[x]!r} on gpu {gpu} after compaction"
                )
            self._compact(k, gpu)
            return False
        self._reload(x, off)
        return True

    def _data_deps(self, deps: dict[int, bool], srcs: Sequence[int]) -> None:
        for src in srcs:
            if deps.get(src) is MEM:
                self.counts["superfluous_mem_edges"] += 1
                self.built -= 1
            deps[src] = DATA

    def _execute_member(self, t: int, m: int, compacted: bool = False) -> None:
        """One sum-into kernel: adds operand x into the group's range, which stays in place (pinned)
        from the first member to the last; the partial is freed after its last use as usual."""
        d, mem = self.d, cast(Members, self.mem)
        k, x, first = mem.acc[m], mem.x[m], mem.first[m]
        res = self.resident
        own = cast(Inst, res[k])
        if res[x] is None:
            pinned = dict(self.open)
            pinned[id(own)] = own
            off = self._make_room(d.gpu[x], self.sizes[x], pinned)
            if off is None:
                if compacted or not first:
                    raise GroupError(
                        f"sum-into member {mem.part[m]} of {d.ids[k]!r}: no room for {d.ids[x]!r} on "
                        f"gpu {d.gpu[x]} beside the open sum",
                        [k, *(i.value for i in self.open.values())],
                    )
                self._compact(k, d.gpu[k], (x,))
                return self._execute_member(t, m, compacted=True)
            self._reload(x, off)
        own = cast(Inst, res[k])
        if first:
            r = self.rec_of[k]
            rec = self.recs[r]
            own.produced = True
            own.writers = []
            self.group_deps[k] = dict(rec.deps)  # memory deps of the range: every member waits for them
            self.open[id(own)] = own
        else:
            r = self._new(MKind.KERNEL, k, d.gpu[k], (t << STEP) | OWN_BIT)
            rec = self.recs[r]
            rec.out = own.loc
            alloc = self.group_deps[k]
            rec.deps.update(alloc)
            self.built += len(alloc)
        rec.acc = mem.parts(m)
        inst = cast(Inst, res[x])
        rec.ins = [inst]
        self._data_deps(rec.deps, inst.writers or (inst.src,))
        inst.readers.append(r)
        writers = cast("list[int]", own.writers)
        writers.append(r)
        own.src = r  # readers name the last member (the runtime's alias of the group)
        uses, nxt, kept = self.uses, self.next, self.kept
        j = nxt[x] = nxt[x] + 1
        if j < len(uses[x]):
            inst.dist = uses[x][j]
        elif x in kept:
            inst.dist = INF
        else:
            self._free(x)
        if not first:
            nxt[k] += 1
        uk, j = uses[k], nxt[k]
        own.dist = uk[j] if j < len(uk) else INF
        if mem.last[m]:
            del self.open[id(own)]
            del self.group_deps[k]
            if j >= len(uk) and k not in kept:
                self._free(k)

    # ---- a part of a split plan (planner.split) ------------------------------------------------
    def _codes(self, gpus: Sequence[int]) -> bytes:
        """Per step of V, what this part does: FULL, SKIP, SOURCE (the read of a transfer to another
        part's GPU) or DEST (a transfer from another part's GPU)."""
        d, n = self.d, len(self.d)
        own = [False] * d.gpus
        for g in gpus:
            own[g] = True
        gpu, kind, operands, acc = d.gpu, d.kind, d.operands, self.mem.acc if self.mem is not None else ()
        out = bytearray(len(self.seq))
        for t, k in enumerate(self.seq):
            if k >= n:
                k = acc[k - n]
            if kind[k] is Kind.TRANSFER:
                src, dst = own[gpu[operands[k][0]]], own[gpu[k]]
                out[t] = FULL if src and dst else DEST if dst else SOURCE if src else SKIP
            elif not own[gpu[k]]:
                out[t] = SKIP
        return bytes(out)

    def _execute_source(self, t: int, compacted: bool = False) -> None:
        """The read half of transfer V[t] to another part's GPU: reloads its operand if need be, and
        notes the read (the part of the destination makes the vertex, planner.split)."""
        d = self.d
        k = self.seq[t]
        (x,) = d.operands[k]
        r = self.rec_of[k]
        if r < 0:  # the transfer as a reader here: a phantom (no location), numbered by its key
            r = self.rec_of[k] = self._new(MKind.TRANSFER, k, d.gpu[k], (t << STEP) | OWN_BIT)
        res = self.resident
        if res[x] is None and not self._bring(k, x, compacted):
            return self._execute_source(t, compacted=True)
        inst = cast(Inst, res[x])
        self.xreads.append((k, x, inst.src, None if inst.writers is None else tuple(inst.writers), inst.loc))
        inst.readers.append(r)
        uses = self.uses[x]
        j = self.next[x] = self.next[x] + 1
        if j < len(uses):
            inst.dist = uses[j]
        elif x in self.kept:
            inst.dist = INF
        else:
            self._free(x)

    def _execute_dest(self, t: int) -> None:
        """The write half of transfer V[t] from another part's GPU: its operand's read comes in
        when the parts are merged."""
        k = self.seq[t]
        own = cast(Inst, self.resident[k])
        own.produced = True
        uk = self.uses[k]
        own.dist = uk[0] if uk else INF
        self.pending[k] = self.rec_of[k]
        if not uk and k not in self.kept:
            self._free(k)

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

    def run(self, gpus: Sequence[int] | None = None, tag: int = 0, parts: int = 1) -> None:
        """Simulates V: on every GPU, or as part `tag` of `parts` on `gpus` only (planner.split)."""
        d = self.d
        n = len(d)
        arenas, failed, wake = self.arenas, self.failed, self.wake
        steps = len(self.seq)
        codes = None
        if gpus is not None and len(gpus) < d.gpus:
            self.gpus = sorted(gpus)
            self.aux, self.stride = tag, parts  # aux keys unique across the parts
            wake.intersection_update(gpus)
            codes = self._codes(gpus)
        c = FULL
        for ex in range(steps):
            self.step = ex
            if wake:  # each GPU whose arena released a range since its horizon stopped, in order
                todo = sorted(wake)
                wake.clear()
                for g in todo:
                    if failed[g] != arenas[g].releases:
                        self._advance(g, ex)
                    if failed[g] < 0:  # held back by the lookahead: again at the next step
                        wake.add(g)
            k = self.seq[ex]
            if codes is not None:
                c = codes[ex]
                if c == SKIP:
                    continue
                if c == SOURCE:
                    self._execute_source(ex)
                    continue
            m = k - n
            if m >= 0:  # a sum-into member
                k = self.alloc_of[ex]
                if k >= 0 and not self.allocated[k]:  # the first: the sum's range is made now
                    g = d.gpu[k]
                    x = cast(Members, self.mem).x[m]
                    pinned = dict(self.open)
                    if (i := self.resident[x]) is not None:
                        pinned[id(i)] = i
                    off = self._make_room(g, self.sizes[k], pinned)
                    if off is None:
                        self._compact(k, g, (x,))
                        self._execute_member(ex, m, compacted=True)
                        continue
                    self._place_output(k, off)
                self._execute_member(ex, m)
                continue
            if not self.allocated[k]:  # the vertex to execute next has no room: evict for it
                g = d.gpu[k]
                off = self._make_room(g, self.sizes[k], self._pinned_for(k))
                if off is None:
                    self._compact(k, g)
                else:
                    self._place_output(k, off)
            if c == FULL:
                self._execute(ex)
            else:
                self._execute_dest(ex)
        self.step = steps
        for o in d.kept:  # an evicted output still in the caller's own copy comes back
            if codes is not None and d.gpu[o] not in self.gpus:
                continue
            if self.resident[o] is None and self.host.get(o, (None, None))[1] is None:
                g = d.gpu[o]
                pinned = {id(i): i for i in self.resident if i is not None}
                off = self._make_room(g, self.sizes[o], pinned)
                if off is None:
                    raise CapacityError(f"output {d.ids[o]!r}: no room on gpu {g} to keep it at the end")
                self._reload(o, off)

    def close(self) -> None:
        """Frees the simulation (Planner.part keeps what the MemGraph needs). Breaks its reference
        cycles (arena blocks <-> neighbours and owners) and drops its records and residents now:
        a split plan frees them while the other parts send theirs."""
        for arena in (*self.arenas, *self.hosts, *self.disks):
            arena.clear()
        self.recs, self.resident, self.uses, self.locs = [], [], [], {}
        self.host, self.host_readers, self.host_block = {}, {}, {}

    # ---- result ---------------------------------------------------------------------------------
    def aux_keys(self) -> list[int]:
        """The sort keys of this simulation's offloads and reloads (the records not of V itself)."""
        return [r.key for r in self.recs if r.out is not None and not r.key & OWN_BIT]

    def part(self, aux: Sequence[int], portable: bool = False) -> Part:
        """This simulation's vertices with their MemGraph ids, given the sorted keys of every
        part's offloads and reloads (`aux`), and its GPUs' figures.

        V[t] itself has one record, the offloads and reloads made at step t sort just before it by
        key, so a record's id is its step plus the offloads and reloads of smaller key: no part
        needs another's records to number its own. Rows are the MemVertex objects, or when
        `portable` (to send to the merging process, planner.split) tuples (id, kind, value, gpu,
        reads, out, acc) with reads as places in `Part.table` of (value, src id, loc), one per
        resident value, shared by its readers.
        """
        recs = self.recs
        keys = np.fromiter([r.key for r in recs], np.int64, len(recs))
        idn = (keys >> STEP) + np.searchsorted(np.asarray(aux, dtype=np.int64), keys)
        ids: list[int] = idn.tolist()
        names = self.d.ids
        pending = {r: k for k, r in self.pending.items()}
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
            if r in pending:  # its read comes from the part of its source (planner.split.merge)
                merged: list = []  # (value, src id, loc) of its read, from planner.split.merge
                row = (ids[r], rec.kind, rec.value, rec.gpu, merged, rec.out, rec.acc)
                held[pending[r]] = (row, {ids[u]: kind for u, kind in deps.items()})
            else:
                if portable:
                    rows.append((ids[r], rec.kind, rec.value, rec.gpu, reads, rec.out, rec.acc))
                else:
                    rows.append(
                        new_vertex(
                            ids[r], rec.kind, names[rec.value], rec.gpu, tuple(reads), rec.out, rec.acc
                        )
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
        gpu, mine = self.d.gpu, set(self.gpus)
        outputs = {}
        for o in self.d.kept:
            if gpu[o] in mine:
                inst = self.resident[o]
                outputs[o] = ids[inst.src if inst is not None else cast(int, self.host[o][1])]
        peaks = {
            g: (
                self.arenas[g].peak,
                self.hosts[g].peak,
                self.hosts[g].high,
                self.disks[g].peak,
                self.disks[g].high,
            )
            for g in self.gpus
        }
        xreads = [
            (k, x, ids[src], None if ws is None else tuple(ids[w] for w in ws), loc)
            for k, x, src, ws, loc in self.xreads
        ]
        return Part(
            rows,
            edges,
            self.gpus,
            outputs,
            peaks,
            dict(self.counts),
            self.built,
            held,
            xreads,
            table if portable else None,
        )


def build_memgraph(
    tg: TaskGraph,
    capacity: int | Sequence[int] | Mapping[int, int],
    *,
    order: Sequence[str] | None = None,
    alignment: int = 256,
    lookahead: int | None = None,
    fit: str = FIT,
    window: int = WINDOW,
    sum_into: str = SUM_INTO,
    host_capacity: int | Sequence[int | None] | Mapping[int, int | None] | None = None,
    workers: int | None = None,
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
        sum_into: how an `accumulate` is planned: "eager" (a sum-into kernel per operand right after
            it, planner.groups), "deferred" (all of them at the accumulate's place) or "off" (one
            kernel reading every operand). A plan in which open sums' ranges block a vertex is
            made again with those groups demoted (eager -> deferred -> one kernel), up to ROUNDS
            times, then with every group in the next mode.
        host_capacity: host-store bytes per GPU (one int, a list or dict per GPU; None or an entry
            None: unbounded). An offload that does not fit goes to the GPU's spill file (disk).
        workers: processes that simulate the GPUs in parallel (planner.split); None: every usable
            CPU when the graph is large and this process runs no other thread, else 1.

    Raises:
        CapacityError: a vertex's inputs plus output do not fit its GPU.
        GraphError: a bad order or capacity.
    """
    started = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # the simulation makes millions of small acyclic objects: cyclic GC passes only cost
    p = None
    try:
        p, parts = _plan_with_groups(
            tg, capacity, order, alignment, lookahead, fit, sum_into, host_capacity, workers
        )
        mg = export(parts, p.d.ids, p.d.kept, p.caps, p.host_asked, started, window)
        log_rounding(p.asked, p.caps, alignment)
    finally:
        if p is not None:
            p.close()
        if collecting:
            _settle()
            gc.enable()
    mg.stats["order"] = p.order_name if order is not None else f"default ({p.order_name})"
    mg.stats["fit"] = fit
    mg.stats["sum_into"] = p.sum_into
    mg.stats["planner_processes"] = len(parts)
    if p.demoted:
        mg.stats["sum_into_demoted"] = {
            m: sum(1 for x in p.demoted.values() if x == m) for m in ("deferred", "off")
        }
    mg._planned_for = id(tg)  # this process's own plan of tg: Program runs it unverified
    return mg


def _settle() -> None:
    """Moves the objects made while the collector was off into its oldest generation, unscanned.

    The plan's millions of objects are long-lived and acyclic, and the planner's own cycles are
    broken (Planner.close), so the young-generation pass that re-enabling the collector would
    start finds nothing; on the 65B prefill plan it took 1.9 s of a 12 s call. freeze() and
    unfreeze() move the generations' lists in O(1); skipped where the caller froze objects itself
    (unfreeze would release theirs).
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def _plan_with_groups(
    tg, capacity, order, alignment, lookahead, fit, sum_into: str, host_capacity, workers
) -> tuple[Planner, list[Part]]:
    """Runs the Planner, demoting the sum-into groups in the way after each GroupError."""
    modes = MODES[MODES.index(sum_into) :]
    demoted: dict[int, str] = {}
    mi = rounds = 0
    while True:
        mode = modes[mi]
        try:
            p = Planner(
                tg,
                capacity,
                order,
                alignment,
                lookahead,
                fit,
                sum_into=mode,
                demoted=demoted,
                host_capacity=host_capacity,
            )
            try:
                parts = groups(p.d.gpu, tg.gpus, workers, len(p.seq))
                if parts is None:
                    p.run()
                    return p, [p.part(sorted(p.aux_keys()))]
                return p, run_split(p, parts)
            except BaseException:
                p.close()  # a failed round's simulation is freed by reference counting too
                raise
        except CapacityError:
            if "off" not in demoted.values():
                raise  # not for want of a demoted group's room: no mode helps
            e: DiscoError = CapacityError("a demoted accumulate does not fit as one kernel")
            rounds = ROUNDS
        except GroupError as ge:
            e = ge.with_traceback(None)  # kept for the end: its frames would hold the failed round
            for k in ge.groups:
                demoted[k] = "off" if demoted.get(k) == "deferred" or mode == "deferred" else "deferred"
        rounds += 1
        if rounds > ROUNDS:
            mi, rounds, demoted = mi + 1, 0, {}
            if mi == len(modes):
                raise e
        log.info("sum-into %s: %s; planning again", mode, e)
