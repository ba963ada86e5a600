"""BUILDMEMGRAPH (TURNIP section 6, Figures 8-9): the simulated execution of a TaskGraph's serial
order V, for real, variably sized tensors on several GPUs.

Two horizons move through V (planner.order): the allocation horizon is pushed greedily ahead of
the execution horizon, giving future outputs their arena range early (fewer constraints at run
time). There is one allocation horizon per GPU, over that GPU's vertices, so a full arena does not
hold the others back. simMalloc takes a free range (planner.arena) and adds memory edges from the
readers of what lay there; simFree releases a value after its last read (planner.state holds the
arenas, the records and these moves; this module chooses them).

When the vertex to execute next has no room, or an operand must come back, victims are chosen by
key (planner.arena.best_window): outputs reserved ahead and not computed yet are *retracted* first
(the allocation undone, to be made again when the horizon returns: no transfer), then a kept value
nobody reads again, then live values by furthest next use. With one tensor size this reloads
exactly what Belady's MIN does for V (planner.bounds; tests/test_belady.py); ranking a reservation
by its own position instead evicts live data that is needed sooner. A produced victim is
offloaded (or just dropped when the host already holds a copy: a graph input's own, or an earlier
offload; to the host store or, past its budget, the spill file) and renamed to its reload for all
later readers.

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

from disco_ray.graph.errors import CapacityError, PlanError

from .records import DATA, MEM, Inst
from .state import INF, State


class Step(enum.IntEnum):
    """What a simulation does at a step of V (one byte per step, `Simulation.codes`)."""

    EXECUTE = 0  # V[t]'s vertex: the paper's step
    SKIP = 1  # nothing: a vertex of another part's GPU (planner.split)
    MEMBER = 2  # one sum-into kernel of an accumulate (planner.sum_into)
    SOURCE = 3  # the read half of a transfer to another part's GPU (planner.split)
    DEST = 4  # the write half of a transfer from another part's GPU (planner.split)


class Simulation(State):
    """The simulated execution of V on every GPU; `run` it, then number its records
    (planner.number)."""

    def codes(self) -> bytes:
        """What this simulation does at each step (a `Step` each)."""
        return bytes(len(self.seq))

    def _handlers(self) -> dict[int, Callable[[int], None]]:
        """The units' steps: code -> what executes step t."""
        return {}

    def _blocked(self, k: int, gpu: int) -> NoReturn:
        """A held range (`open`) is in the way of compacting vertex k's operands on `gpu`."""
        raise PlanError(f"internal: vertex {self.d.ids[k]!r}: a held range blocks compaction on gpu {gpu}")

    # ---- victims --------------------------------------------------------------------------------
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
