"""BUILDMEMGRAPH (TURNIP section 6, Figures 8-9): the simulated execution of a TaskGraph's serial
order V, for real, variably sized tensors on several GPUs.

Two horizons move through V (planner.order): the allocation horizon is pushed greedily ahead of
the execution horizon, giving future outputs their arena range early (fewer constraints at run
time). There is one allocation horizon per GPU, over that GPU's vertices, so a full arena does not
hold the others back. simMalloc takes a free range (planner.arena) and adds memory edges from the
readers of what lay there; simFree releases a value after its last read.

When the vertex to execute next has no room, or an operand must come back, victims are chosen by
key (planner.arena.best_window): outputs reserved ahead and not computed yet are *retracted* first
(the allocation undone, to be made again when the horizon returns: no transfer), then a kept value
nobody reads again, then live values by furthest next use. With one tensor size this reloads
exactly what Belady's MIN does for V (planner.bounds; tests/test_belady.py); ranking a reservation
by its own position instead evicts live data that is needed sooner. A produced victim is
offloaded (or just dropped when the host already holds a copy: a graph input's own, or an earlier
offload) and renamed to its reload for all later readers.

Memory tiers: each GPU's host store is an Arena, unbounded or of a budget (`host_capacity`); an
offload that finds no free range of the budget goes to that GPU's spill file instead (an
unbounded Arena of DISK_ALIGN-aligned ranges, so that the worker reads and writes it with
O_DIRECT), with the same range rules and memory edges; once host ranges free up, later offloads
go to the host again. Rejected: moving host residents down to disk to make room (a host-to-disk
vertex kind of its own) - a full host store simply sends the newer victims down.

Vertices created while executing V[t] (offloads, reloads) sort just before V[t]; every edge then
points forward (section 7), so the MemGraph ids are a topological order, which the runtime uses as
its priority (planner.number). If the operands of one kernel fragment its arena so badly that no
window fits, the kernel is *compacted*: its output and operands are placed back to back from
offset 0 (pre-checked to fit), evicting whatever lies there.

What the units around this simulation add (planner.buildmemgraph composes them): each step of V
has a code (`Step`); this class executes EXECUTE steps, the units register handlers for theirs.
planner.sum_into simulates an `accumulate` as members (MEMBER steps) whose range is *held* in place
(`open`) and has several writers (`Inst.writers`); planner.split simulates some GPUs only (SKIP,
and the two halves of a transfer between parts, SOURCE and DEST).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn, cast

import numpy as np

from disco_ray.graph.errors import CapacityError, PlanError
from disco_ray.graph.memgraph import DISK, HOST, INPUT, Loc, MKind
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .arena import RESERVED, Arena, Block
from .capacity import aligned, capacities, host_capacities, rounded
from .dense import Dense, check_fits, check_order
from .order import default
from .records import DATA, MEM, OWN, STEP, Inst, Rec

OWN_BIT = 1 << OWN
INF = float("inf")
FIT = "oldest"  # the default free-range choice (planner.arena), by simulated makespan
DISK_ALIGN = 4096  # spill-file ranges: O_DIRECT's alignment of offsets and sizes (actors/diskio.py)
_MKIND = {Kind.INPUT: MKind.INPUT, Kind.KERNEL: MKind.KERNEL, Kind.TRANSFER: MKind.TRANSFER}


class Step(enum.IntEnum):
    """What a simulation does at a step of V (one byte per step, `Simulation.codes`)."""

    EXECUTE = 0  # V[t]'s vertex: the paper's step
    SKIP = 1  # nothing: a vertex of another part's GPU (planner.split)
    MEMBER = 2  # one sum-into kernel of an accumulate (planner.sum_into)
    SOURCE = 3  # the read half of a transfer to another part's GPU (planner.split)
    DEST = 4  # the write half of a transfer from another part's GPU (planner.split)


class Simulation:
    """The simulated execution of V on every GPU; `run` it, then number its records
    (planner.number). `counts` and the arenas' peaks are its statistics."""

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

    # ---- what the units refine ----------------------------------------------------------------
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

    def codes(self) -> bytes:
        """What this simulation does at each step (a `Step` each)."""
        return bytes(len(self.seq))

    def _handlers(self) -> dict[int, Callable[[int], None]]:
        """The units' steps: code -> what executes step t."""
        return {}

    def _blocked(self, k: int, gpu: int) -> NoReturn:
        """A held range (`open`) is in the way of compacting vertex k's operands on `gpu`."""
        raise PlanError(f"internal: vertex {self.d.ids[k]!r}: a held range blocks compaction on gpu {gpu}")

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

    def _room_for_output(self, k: int) -> None:
        """Evicts (or compacts) for the output of the vertex to execute next, which has no room."""
        g = self.d.gpu[k]
        off = self._make_room(g, self.sizes[k], self._pinned_for(k))
        if off is None:
            self._compact(k, g)
        else:
            self._place_output(k, off)

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
                self._blocked(k, gpu)
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

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> None:
        """Simulates V: each step's code (`codes`) says what it does."""
        seq, allocated = self.seq, self.allocated
        arenas, failed, wake = self.arenas, self.failed, self.wake
        codes, handlers, skip = self.codes(), self._handlers(), int(Step.SKIP)
        for ex in range(len(seq)):
            self.step = ex
            if wake:  # each GPU whose arena released a range since its horizon stopped, in order
                todo = sorted(wake)
                wake.clear()
                for g in todo:
                    if failed[g] != arenas[g].releases:
                        self._advance(g, ex)
                    if failed[g] < 0:  # held back by the lookahead: again at the next step
                        wake.add(g)
            c = codes[ex]
            if c:
                if c != skip:
                    handlers[c](ex)
                continue
            k = seq[ex]
            if not allocated[k]:  # the vertex to execute next has no room: evict for it
                self._room_for_output(k)
            self._execute(ex)
        self.step = len(seq)
        self._keep_outputs()

    def _keep_outputs(self) -> None:
        """An evicted output still in the caller's own copy comes back at the end."""
        d, mine = self.d, set(self.gpus)
        for o in d.kept:
            if d.gpu[o] not in mine:
                continue
            if self.resident[o] is None and self.host.get(o, (None, None))[1] is None:
                g = d.gpu[o]
                pinned = {id(i): i for i in self.resident if i is not None}
                off = self._make_room(g, self.sizes[o], pinned)
                if off is None:
                    raise CapacityError(f"output {d.ids[o]!r}: no room on gpu {g} to keep it at the end")
                self._reload(o, off)

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
