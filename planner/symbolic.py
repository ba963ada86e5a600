"""Symbolic execution of a MemGraph: runs it in random valid orders over arenas of value tags.

Independent of `planner.verify` (it shares no code with it): where the verifier reasons about
reachability, this simply executes. Each arena (a GPU's, or a GPU's host store or spill file) is cut into the
elementary segments between all range boundaries used on it; a segment holds the id of the
vertex whose write last landed there. A vertex, on start, checks that each read sees its src's
tag, then marks its output range as being written (a write may land any time while it runs); on
completion it checks its reads again (it read throughout) and tags its output with its own id.
With `in_flight` > 1 several vertices run at once and complete in random order, so a writer that
the edges leave unordered against a reader is caught whichever way it falls. No math is done.

Sum-into groups (MemGraph vertices with `accumulate`, one group per value) run as the runtime runs
them: one member at a time (the write lock), in any order. A member after the first reads the
sum's range too (it adds into it), so it must find the group's partial sum there; the range holds
that partial-sum tag until the last member completes, then the tag of the group's last member
by id, the writer its readers name: a reader that does not wait for every member finds a partial
sum, and a writer that lands between members is found by the next member.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from typing import cast

import numpy as np

from disco_ray.graph.errors import VerifyError
from disco_ray.graph.memgraph import INPUT, TIERS, Loc, MemGraph, MemVertex, MKind
from disco_ray.graph.taskgraph import Kind, TaskGraph

EMPTY = -1  # nothing written yet


def busy(i: int) -> int:
    """The tag of bytes that vertex position `i` is writing (garbage until it completes)."""
    return -2 - i


def _arena(loc: Loc, gpu: int) -> tuple[int, int]:
    """Host stores and spill files are per GPU: HOST and DISK name the vertex's own GPU's."""
    return (gpu, loc.device) if loc.device in TIERS else (loc.device, 0)


def _name(loc: Loc, gpu: int) -> str:
    dev = f"{TIERS[loc.device]}(gpu:{gpu})" if loc.device in TIERS else f"gpu:{loc.device}"
    return f"{dev}[{loc.offset}:{loc.end}]"


class _Machine:
    """Arenas of segment tags plus each location's segment span, precomputed once per MemGraph."""

    def __init__(self, mg: MemGraph):
        self.mg = mg
        self.verts = mg.vertices
        self.pos = {v.id: i for i, v in enumerate(self.verts)}
        bounds: dict[tuple[int, int], set[int]] = {}
        for v in self.verts:
            for loc in self._locs(v):
                b = bounds.setdefault(_arena(loc, v.gpu), set())
                b.add(loc.offset)
                b.add(loc.end)
        self.cuts = {k: np.array(sorted(b), dtype=np.int64) for k, b in bounds.items()}
        self.span: dict[tuple[tuple[int, int], int, int], tuple[int, int]] = {}
        for v in self.verts:
            for loc in self._locs(v):
                k = _arena(loc, v.gpu)
                c = self.cuts[k]
                self.span[(k, loc.offset, loc.end)] = (
                    int(np.searchsorted(c, loc.offset)),
                    int(np.searchsorted(c, loc.end)),
                )
        self.preds: list[set[int]] = [set(p) for p in mg.preds()]  # by position, duplicates merged
        self.succs: list[list[int]] = mg.succs()
        # sum-into groups: member position -> group index; per group its parts and last member
        names: dict[str, int] = {}
        self.group: dict[int, int] = {}
        self.size: list[int] = []
        self.rep: list[int] = []
        for i, v in enumerate(self.verts):
            if v.acc is not None:
                g = names.setdefault(v.value, len(names))
                if g == len(self.size):
                    self.size.append(v.acc[1])
                    self.rep.append(i)
                self.group[i] = g
                if v.id > self.verts[self.rep[g]].id:
                    self.rep[g] = i
        self.names = list(names)

    def partial(self, g: int) -> int:
        """The tag of a group's range after some, not all, of its members."""
        return -2 - len(self.verts) - g

    @staticmethod
    def _locs(v: MemVertex) -> Iterable[Loc]:
        if v.out.device != INPUT:
            yield v.out
        for r in v.ins:
            if r.loc.device != INPUT:
                yield r.loc

    def segs(self, loc: Loc, gpu: int) -> tuple[tuple[int, int], int, int]:
        k = _arena(loc, gpu)
        i, j = self.span[(k, loc.offset, loc.end)]
        return k, i, j

    def new_arenas(self) -> dict[tuple[int, int], np.ndarray]:
        return {k: np.full(max(len(c) - 1, 0), EMPTY, dtype=np.int64) for k, c in self.cuts.items()}

    def found(self, tag: int) -> str:
        if tag == EMPTY:
            return "nothing (never written)"
        if tag < -1 - len(self.verts):
            return f"a partial sum of {self.names[-2 - len(self.verts) - tag]!r} (not every member ran)"
        if tag < EMPTY:
            v = self.verts[-2 - tag]
            return f"{v.value!r} half-written (vertex {v.id}, {v.kind.value}, still running)"
        v = self.verts[tag]
        return f"{v.value!r} (written by vertex {v.id}, {v.kind.value})"


def execute(
    tg: TaskGraph,
    mg: MemGraph,
    rng: random.Random,
    *,
    in_flight: int = 1,
    policy: str = "uniform",
    _machine: _Machine | None = None,
) -> None:
    """Runs `mg` once in a random order allowed by its edges, up to `in_flight` vertices at a time.

    `policy` picks the next vertex to start: "uniform" draws among the ready ones; "priority" draws
    a random priority per vertex and starts the ready one of highest priority, which lets some
    vertices lag far behind (a long-delayed load or a racing writer that runs very late).

    Raises:
        VerifyError: a read saw another value than its src wrote, an output is not in place at
            the end, or the edges leave some vertex never ready (a cycle).
    """
    run = _Run(tg, _machine or _Machine(mg), rng, policy)
    run.run(in_flight)
    run.check_outputs(tg, mg)


class _Run:
    """One execution: the arenas' tags, the vertices waiting, ready and running, and the sum-into
    groups' write locks."""

    def __init__(self, tg: TaskGraph, m: _Machine, rng: random.Random, policy: str):
        self.m, self.rng = m, rng
        self.verts, self.pos = m.verts, m.pos
        self.arenas = m.new_arenas()
        self.inputs = {t.id for t in tg if t.kind is Kind.INPUT}
        self.waiting = [len(p) for p in m.preds]
        if policy not in ("uniform", "priority"):
            raise ValueError(f"policy must be 'uniform' or 'priority', got {policy!r}")
        self.prio = [rng.random() for _ in self.verts] if policy == "priority" else None
        self.ready = [i for i, c in enumerate(self.waiting) if c == 0]  # policy "uniform"
        self.heap: list[tuple[float, int]] = []  # policy "priority": (priority, vertex)
        if self.prio is not None:
            self.heap = [(self.prio[i], i) for i in self.ready]
            heapq.heapify(self.heap)
            self.ready = []
        self.running: list[int] = []
        self.done = 0
        self.added: list[set[int]] = [set() for _ in m.size]  # per sum-into group: the parts added
        self.locked: set[int] = set()  # groups with a member running
        self.parked: dict[int, list[int]] = {}  # group -> its ready members waiting for the lock

    def run(self, in_flight: int) -> None:
        """Starts and completes vertices in a random order until none is left."""
        rng, ready, heap, running, m = self.rng, self.ready, self.heap, self.running, self.m
        while ready or heap or running:
            if (ready or heap) and len(running) < in_flight and (not running or rng.random() < 0.5):
                if self.prio is None:
                    k = rng.randrange(len(ready))
                    ready[k], ready[-1] = ready[-1], ready[k]
                    i = ready.pop()
                else:
                    i = heapq.heappop(heap)[1]
                g = m.group.get(i)
                if g is not None and g in self.locked:
                    self.parked.setdefault(g, []).append(i)  # another member holds the write lock
                else:
                    self.start(i)
            else:
                k = rng.randrange(len(running))
                running[k], running[-1] = running[-1], running[k]
                self.finish(running.pop())
        verts = self.verts
        if self.done != len(verts):
            stuck = [verts[i].id for i, c in enumerate(self.waiting) if c > 0][:5]
            raise VerifyError(
                f"{len(verts) - self.done} vertices never became ready (a cycle?), e.g. {stuck}"
            )

    def _push(self, i: int) -> None:
        if self.prio is None:
            self.ready.append(i)
        else:
            heapq.heappush(self.heap, (self.prio[i], i))

    def check_reads(self, i: int, when: str) -> None:
        verts, m = self.verts, self.m
        v = verts[i]
        for n, r in enumerate(v.ins):
            if r.src is None:
                if r.loc.device != INPUT or r.value not in self.inputs or v.kind is not MKind.RELOAD:
                    raise VerifyError(
                        f"vertex {v.id} ({v.kind.value} on gpu:{v.gpu}) read {n} of {r.value!r} "
                        f"has no src and is not a reload of a graph input"
                    )
                continue
            want = self.pos.get(r.src)
            if want is None:
                raise VerifyError(f"vertex {v.id}: read {n} of {r.value!r} names unknown src {r.src}")
            k, a, b = m.segs(r.loc, v.gpu)
            seg = self.arenas[k][a:b]
            bad = np.flatnonzero(seg != want)
            if bad.size or verts[want].value != r.value:
                got = int(seg[bad[0]]) if bad.size else want
                raise VerifyError(
                    f"vertex {v.id} ({v.kind.value} {v.value!r} on gpu:{v.gpu}) {when}: read {n} "
                    f"expects {r.value!r} from vertex {r.src} at {_name(r.loc, v.gpu)}, "
                    f"found {m.found(got)}"
                )

    def start(self, i: int) -> None:
        self.check_reads(i, "on start")
        m, v = self.m, self.verts[i]
        g = m.group.get(i)
        if g is not None:
            self.locked.add(g)
            added = self.added[g]
            if cast("tuple[int, int]", v.acc)[0] in added:
                raise VerifyError(f"vertex {v.id}: part {v.acc} of {v.value!r} was added already")
            if added:  # it adds into the partial sum the earlier members left
                k, a, b = m.segs(v.out, v.gpu)
                seg = self.arenas[k][a:b]
                bad = np.flatnonzero(seg != m.partial(g))
                if bad.size:
                    raise VerifyError(
                        f"vertex {v.id} (sum-into {v.acc} of {v.value!r} on gpu:{v.gpu}) on start: "
                        f"expects the partial sum of {len(added)} members at {_name(v.out, v.gpu)}, "
                        f"found {m.found(int(seg[bad[0]]))}"
                    )
        if v.out.device != INPUT:
            k, a, b = m.segs(v.out, v.gpu)
            self.arenas[k][a:b] = busy(i)
        self.running.append(i)

    def finish(self, i: int) -> None:
        self.check_reads(i, "on completion")
        m, v = self.m, self.verts[i]
        tag = i
        g = m.group.get(i)
        if g is not None:
            added = self.added[g]
            added.add(cast("tuple[int, int]", v.acc)[0])
            tag = m.rep[g] if len(added) == m.size[g] else m.partial(g)
            self.locked.discard(g)
            for p in self.parked.pop(g, ()):
                self._push(p)
        if v.out.device != INPUT:
            k, a, b = m.segs(v.out, v.gpu)
            self.arenas[k][a:b] = tag
        self.done += 1
        waiting = self.waiting
        for w in m.succs[i]:
            waiting[w] -= 1
            if waiting[w] == 0:
                self._push(w)

    def check_outputs(self, tg: TaskGraph, mg: MemGraph) -> None:
        """Every output is in place at the end, as its own value."""
        verts, pos, m = self.verts, self.pos, self.m
        for name in tg.kept:
            vid = mg.outputs.get(name)
            if vid is None or vid not in pos:
                raise VerifyError(f"output {name!r}: no MemGraph vertex holds it")
            o = verts[pos[vid]]
            seg_key, a, b = m.segs(o.out, o.gpu)
            for tag in self.arenas[seg_key][a:b]:
                if tag < 0 or verts[tag].value != name:
                    raise VerifyError(
                        f"output {name!r} at {_name(o.out, o.gpu)} (vertex {vid}): at the end "
                        f"found {m.found(int(tag))}"
                    )


def check_random_orders(
    tg: TaskGraph, mg: MemGraph, n_orders: int, seed: int, *, in_flight: Iterable[int] = (1, 2, 4, 16)
) -> None:
    """Executes `mg` in `n_orders` random orders, cycling through the `in_flight` widths and both policies.

    Raises:
        VerifyError: from the first failing order, with the seed, order number and mode appended.
    """
    m = _Machine(mg)
    modes = [(k, p) for p in ("uniform", "priority") for k in in_flight]
    for n in range(n_orders):
        k, p = modes[n % len(modes)]
        rng = random.Random(f"{seed}:{n}")
        try:
            execute(tg, mg, rng, in_flight=k, policy=p, _machine=m)
        except VerifyError as e:
            raise VerifyError(f"{e} [seed {seed}, order {n}, in_flight {k}, {p}]") from None
