"""Sum-into groups (TURNIP appendix A) in the simulation: what they add to BUILDMEMGRAPH.

The paper's simulation executes each vertex of V as one step. An `accumulate` is simulated here
as one step per operand instead, its members (planner.groups places them in V: "eager" right
after each operand, "deferred" at the accumulate's place). The first member allocates the sum's
range (a reservation like any output); from it to the last the range is *held* (`open`: no victim,
no compaction moves it), since every member must write the same bytes; each member gets the
range's memory deps, and whatever reads, offloads or overwrites the sum afterwards depends on all
members (`Inst.writers`). Members get no edges among themselves. A vertex that finds no room
because of an open sum raises GroupError, and planner.buildmemgraph plans again with that group
demoted (`demote`): eager -> deferred -> one n-ary kernel ("off").

A member needs the sum's range and its operand at once, which the capacity check counts; a member
is a step code n + m in `seq` (n: the TaskGraph's vertex count), its step code Step.MEMBER.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn, cast

import numpy as np

from disco_ray.graph.errors import PlanError
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.taskgraph import TaskGraph

from .dense import Dense
from .groups import MODES, Members
from .records import STEP, Inst
from .simulation import Simulation, Step
from .state import FIT, INF, OWN_BIT

SUM_INTO = "eager"  # how an `accumulate` is planned (planner.groups.MODES)


class GroupError(PlanError):
    """An open sum-into group's range is in the way (it may not move between its members)."""

    def __init__(self, msg: str, groups: Sequence[int]):
        super().__init__(msg)
        self.groups = tuple(groups)  # the accumulates (positions) whose open sums were in the way

    def __reduce__(self):  # sent from a forked part (planner.split)
        return GroupError, (str(self), self.groups)


def demote(demoted: dict[int, str], groups: Sequence[int], mode: str) -> None:
    """Plans the groups that were in the way one mode further next time (eager -> deferred -> off)."""
    for k in groups:
        demoted[k] = "off" if demoted.get(k) == "deferred" or mode == "deferred" else "deferred"


class SumIntoSimulation(Simulation):
    """The simulation with every `accumulate` (not demoted to "off") as sum-into members."""

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
        d = dense if dense is not None else Dense(tg)
        self.sum_into = sum_into
        self.demoted = dict(demoted or {})
        self.mem = Members(d, self.demoted) if sum_into != "off" else None
        self.group_deps: dict[int, dict[int, bool]] = {}  # group -> memory deps of its range
        super().__init__(tg, capacity, order, alignment, lookahead, fit, dense=d, host_capacity=host_capacity)

    # ---- the refinements of the simulation ----------------------------------------------------
    def _needs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A member needs the sum and one operand at once (instead of the accumulate's operands)."""
        ks, gs, need = super()._needs()
        if self.mem is not None and self.mem.of:
            sizes, d = self.sizes, self.d
            need = need.copy()
            nt = 2 * len(d) - len(ks)  # the rows of non-transfers come first, by position
            for k, ms in self.mem.of.items():
                i = int(np.searchsorted(ks[:nt], k))
                need[i] = sizes[k] + max(sizes[self.mem.x[m]] for m in ms)
        return ks, gs, need

    def _serial(self, seq: list[int]) -> list[int]:
        """V with every accumulate replaced by its members (planner.groups)."""
        mem = self.mem
        return mem.expand(seq, self.sum_into) if mem is not None and len(mem) else seq

    def _index(self) -> None:
        """A member reads its operand and, unless it is the first, adds into the sum (reads it)."""
        mem = self.mem
        if mem is None or not len(mem):
            return super()._index()
        n = len(self.d)
        alloc_of, pos, uses, operands = self.alloc_of, self.pos, self.uses, self.d.operands
        for t, k in enumerate(self.seq):
            if k >= n:
                j = k - n
                k = alloc_of[t] = mem.acc[j]
                uses[mem.x[j]].append(t)
                if not mem.first[j]:
                    uses[k].append(t)
                    alloc_of[t] = -1
                    continue
            else:
                for i in operands[k]:
                    uses[i].append(t)
            pos[k] = t

    def codes(self) -> bytes:
        codes = super().codes()
        if self.mem is None or not len(self.mem):
            return codes
        out = np.frombuffer(codes, dtype=np.uint8).copy()
        out[np.asarray(self.seq, dtype=np.int64) >= len(self.d)] = Step.MEMBER
        return out.tobytes()

    def _handlers(self) -> dict[int, Callable[[int], None]]:
        return {**super()._handlers(), Step.MEMBER: self._member_step}

    def _blocked(self, k: int, gpu: int) -> NoReturn:
        raise GroupError(
            f"vertex {self.d.ids[k]!r}: an open sum-into range blocks compaction on gpu {gpu}",
            [i.value for i in self.open.values()],
        )

    # ---- the members --------------------------------------------------------------------------
    def _member_step(self, t: int) -> None:
        """Sum-into member V[t]; the first makes the sum's range (evicting, or compacting, for it)."""
        m = self.seq[t] - len(self.d)
        k = self.alloc_of[t]
        if k >= 0 and not self.allocated[k]:
            g = self.d.gpu[k]
            x = cast(Members, self.mem).x[m]
            pinned = dict(self.open)
            if (i := self.resident[x]) is not None:
                pinned[id(i)] = i
            off = self._make_room(g, self.sizes[k], pinned)
            if off is None:
                self._compact(k, g, (x,))
                return self._execute_member(t, m, compacted=True)
            self._place_output(k, off)
        self._execute_member(t, m)

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
        cast("list[int]", own.writers).append(r)
        own.src = r  # readers name the last member (the runtime's alias of the group)
        self._read(x, inst)
        nxt = self.next
        if not first:
            nxt[k] += 1
        uk, j = self.uses[k], nxt[k]
        own.dist = uk[j] if j < len(uk) else INF
        if mem.last[m]:
            del self.open[id(own)]
            del self.group_deps[k]
            if j >= len(uk) and k not in self.kept:
                self._free(k)
