"""A worker's local dependency core (counters over its own GPU's edges, the ready heaps, the
chains it runs as units): pure, driven by `actors.executor`; which vertex goes to which stream is
`actors.slots.StreamSlots`.

A vertex of this GPU is ready when (a) the coordinator has dispatched it (its predecessors on
other GPUs are done, see `actors.scheduler`) and (b) its predecessors on this GPU are done; the
worker counts (b) itself, so a chain of vertices on one GPU runs without any round trip.

Launch ahead: a dispatched kernel whose local predecessors have all been LAUNCHED (some still
running) is `queued`: the executor may put it on a stream behind them, the stream waiting on
their completion itself (a CUDA event), so the GPU never idles while the host prepares the next
kernel of a chain. Copies (loads, offloads, transfers) are only ever started when ready: a copy
lane is FIFO, and a copy queued on it ahead of time would hold back every later copy.

Nothing is launched ahead behind a vertex whose device work another thread enqueues at a time of
its own (`aside`: a BLOCKING transfer a helper runs, a DEFERRED NCCL receive the channel posts in
its order): its successors wait for its completion. A kernel queued behind such a vertex would
hold its stream until that thread enqueued it, and an NCCL receive is enqueued only after every
lower transfer of its communicator, whose sources may be queued on that very stream behind the
kernel: a deadlock (docs/RUNTIME.md, "Launch ahead and NCCL").

Sum-into groups (TURNIP appendix A): the kernels of one `accumulate` (MemGraph vertices with
`acc`) add their operands into one range in any order, one at a time: the core makes at most one
member of a group ready at once (the group's write lock, taken when a member becomes ready and
released when it completes); the others wait, by id, until it is released. Members are never
launched ahead.

Priority: when a stream frees, the worker starts the ready vertex with the LOWEST MemGraph id.
The planner numbers vertices in its serial order (the simulated execution BUILDMEMGRAPH followed,
TURNIP section 6), so lowest-id-first follows that plan where it can and deviates only when the
planned next vertex is not ready yet (work conservation, TURNIP section 5).
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable, Mapping, Set

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MemGraph, MKind


class WorkerCore:
    """Local counters of the vertices of `gpu`; `start` resets them for a new run; `streams`: the
    compute streams its chains are for (`chains`)."""

    def __init__(self, mg: MemGraph, gpu: int, streams: int = 1):
        self.gpu = gpu
        gpu_of = {v.id: v.gpu for v in mg.vertices}
        self.mine = [v.id for v in mg.vertices if v.gpu == gpu]
        self.total = len(self.mine)
        self.groups = {v.id: v.value for v in mg.vertices if v.gpu == gpu and v.acc is not None}
        self.kernels = frozenset(
            v.id for v in mg.vertices if v.gpu == gpu and v.kind is MKind.KERNEL and v.id not in self.groups
        )
        preds: dict[int, int] = dict.fromkeys(self.mine, 0)
        self.local_succs: dict[int, list[int]] = {}
        self.local_preds: dict[int, list[int]] = {}
        awaited = set()  # this GPU's vertices with a successor on another GPU
        remote = set()  # and those with a predecessor there
        for u, w in dict.fromkeys((e[0], e[1]) for e in mg.edges):
            if gpu_of[w] == gpu and gpu_of[u] == gpu:
                preds[w] += 1
                self.local_succs.setdefault(u, []).append(w)
                self.local_preds.setdefault(w, []).append(u)
            elif gpu_of[u] == gpu:
                awaited.add(u)
            elif gpu_of[w] == gpu:
                remote.add(w)
        self.awaited = frozenset(awaited)
        self._preds0 = preds
        all_kernels = {v.id for v in mg.vertices if v.gpu == gpu and v.kind is MKind.KERNEL}
        # each chain member -> its chain (one tuple shared by its members), its predecessors'
        # positions in it, its own position
        self.chain_of, self._unit_preds, self._pos = chains(
            all_kernels,
            self.kernels,
            self.local_succs,
            self.local_preds,
            remote,
            awaited,
            several=streams > 1,
        )
        self.start()

    def start(self, ahead: bool = True, aside: Container[int] = frozenset()) -> None:
        """A new run; `ahead`: track launches for launch ahead (`launch`, `pop_queued`);
        `aside`: vertices nothing is launched ahead behind (their successors count them launched
        only once they complete)."""
        self.ahead = ahead
        self.aside = aside
        self.left = dict(self._preds0)  # local predecessors not done
        self.unlaunched = dict(self._preds0) if ahead else {}  # local predecessors not launched
        self.dispatched: set[int] = set()
        self.launched: set[int] = set()
        self.ready: list[int] = []  # heap of ids: dispatched, local predecessors done
        self.queued: list[int] = []  # heap of kernel ids: dispatched, local predecessors launched
        self.held: set[str] = set()  # sum-into groups with a member ready or running
        self.parked: dict[str, list[int]] = {}  # group -> heap of its other ready members
        self.done = 0

    def _ready(self, v: int) -> None:
        key = self.groups.get(v)
        if key is None:
            heapq.heappush(self.ready, v)
        elif key in self.held:
            heapq.heappush(self.parked.setdefault(key, []), v)
        else:
            self.held.add(key)
            heapq.heappush(self.ready, v)

    def dispatch(self, vids: Iterable[int]) -> None:
        """The coordinator hands over `vids`; those whose local predecessors are done become ready."""
        for v in vids:
            if v not in self.left:
                raise RunError(f"gpu:{self.gpu} was handed vertex {v}, which is not one of its vertices")
            if v in self.dispatched:
                raise RunError(f"gpu:{self.gpu} was handed vertex {v} twice")
            self.dispatched.add(v)
            if self.left[v] == 0:
                self._ready(v)
            elif self.ahead and self.unlaunched[v] == 0 and v in self.kernels:
                heapq.heappush(self.queued, v)

    def launch(self, vid: int, completed: bool = False) -> None:
        """`vid` was handed to a stream (or, `completed`, an `aside` vertex finished: only now do
        its successors count it launched); its kernel successors whose every local predecessor is
        now launched become queued (only while tracking launches: `start(ahead=True)`)."""
        if not self.ahead:
            return
        if not completed:
            self.launched.add(vid)
            if vid in self.aside:  # its successors count it launched once it completes
                return
        unlaunched, left, dispatched, kernels = self.unlaunched, self.left, self.dispatched, self.kernels
        for w in self.local_succs.get(vid, ()):
            k = unlaunched[w] - 1
            unlaunched[w] = k
            if k == 0 and w in dispatched and left[w] and w in kernels:
                heapq.heappush(self.queued, w)

    def complete(self, vid: int) -> None:
        """`vid` finished; its local successors that are dispatched, unblocked and not launched
        yet become ready."""
        self.done += 1
        key = self.groups.get(vid)
        if key is not None:  # the group's lock passes to its next ready member, if any
            self.held.discard(key)
            waiting = self.parked.get(key)
            if waiting:
                self._ready(heapq.heappop(waiting))
        for w in self.local_succs.get(vid, ()):
            k = self.left[w] - 1
            self.left[w] = k
            if k == 0 and w in self.dispatched and w not in self.launched:
                self._ready(w)
        if self.ahead and vid in self.aside:  # its successors may now go behind their other predecessors
            self.launch(vid, completed=True)

    def claim(
        self, vid: int, running: Mapping[int, tuple[int, int]] | None = None, s: int = -1
    ) -> tuple[int, ...]:
        """`vid`, ready or launched ahead, and the members of its chain (`chains`) after it that
        may run right behind it on its stream `s`, as one unit: each dispatched, with at least one
        local predecessor in the unit, and every other one done or, with launch ahead (`running`:
        vertex -> (launch number, stream) of those in flight), in flight on `s` itself, which
        runs it first. They count as launched: their completion readies nothing twice. A member
        that waits on anything else ends the unit; it runs when ready, as any vertex."""
        chain = self.chain_of.get(vid)
        if chain is None:
            return (vid,)
        out = [vid]
        start, left, dispatched, launched, preds, local = (
            self._pos[vid],
            self.left,
            self.dispatched,
            self.launched,
            self._unit_preds,
            self.local_preds,
        )
        for j in range(start + 1, len(chain)):
            w = chain[j]
            need = 0
            for i in preds[w]:
                if i >= start:
                    need += 1
            if not need or w not in dispatched or w in launched:
                break
            if left[w] != need:  # others not done: on this stream ahead of the unit, or it ends
                if running is None:
                    break
                for u in local[w]:
                    at = running.get(u)
                    if at is not None and at[1] == s:
                        need += 1
                if left[w] != need:
                    break
            out.append(w)
            launched.add(w)
        return tuple(out)

    def pop(self) -> int | None:
        """The ready vertex with the lowest id (the planner's order), or None."""
        return heapq.heappop(self.ready) if self.ready else None

    def pop_queued(self) -> int | None:
        """The queued kernel with the lowest id that is still waiting on a running predecessor
        (one that became ready meanwhile is served by `pop`), or None."""
        q = self.queued
        while q:
            v = heapq.heappop(q)
            if v not in self.launched and self.left[v]:
                return v
        return None

    @property
    def finished(self) -> bool:
        return self.done == self.total


LOOK = 32  # how far a region grows past its last valid end before it gives up


def _region(
    h: int,
    plain: Container[int],
    succs: Mapping[int, list[int]],
    preds: Mapping[int, list[int]],
    remote: Container[int],
    awaited: Container[int],
    taken: Container[int],
) -> list[int]:
    """The longest run of kernels from `h`, grown by the lowest-id successor of its members, in
    which every member but the last has all its successors later in the run: nothing outside it
    waits on an inner member (a fan-out inside, such as a norm feeding two projections, runs its
    branches one after the other on the unit's stream)."""
    run, members = [h], {h}
    best, ext = 1, len(succs.get(h, ()))  # edges from members to vertices outside the run
    frontier = list(succs.get(h, ()))
    heapq.heapify(frontier)
    while frontier and len(run) - best < LOOK and run[-1] not in awaited:
        x = heapq.heappop(frontier)
        if x in members:
            continue
        if x not in plain or x in remote or x in taken:
            break
        run.append(x)
        members.add(x)
        out = succs.get(x, ())
        ext += len(out) - sum(1 for u in preds.get(x, ()) if u in members)
        for y in out:
            heapq.heappush(frontier, y)
        if ext == len(out):  # every edge leaving the run leaves from its last member
            best = len(run)
    return run[:best]


def chains(
    kernel_set: Set[int],
    plain: Container[int],
    succs: Mapping[int, list[int]],
    preds: Mapping[int, list[int]],
    remote: Container[int],
    awaited: Container[int],
    several: bool = False,
) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]], dict[int, int]]:
    """Chains of one GPU's kernels (`kernel_set`) that a compute stream may run back to back, as
    one unit, with no bookkeeping between them (docs/RUNTIME.md, "Chains"). Always: v -> w only
    when both are plain kernels (`plain`: not sum-into members), v has no successor on another
    GPU and w no predecessor there.
    - One compute stream (`several` False): runs of consecutive kernel ids (the planner's serial
      order, so lowest-id-first runs them in this order on one stream anyway), linked when v
      has no successor but kernels (a copy that waits on v, such as the next
      weight's load into a range v reads, must not wait for the whole unit).
    - Several (`several`): regions (`_region`): from each kernel not in a chain yet, the longest
      run grown by the lowest-id successor of its members in which every member but the last
      has all its successors later in the run: nothing outside a unit waits on an inner member.
    Returns (each member -> its chain, each member -> the positions of its predecessors in its
    chain, each member -> its position)."""
    kernels = sorted(kernel_set)
    runs: list[list[int]] = []
    if several:
        taken: set[int] = set()
        for h in kernels:
            if h not in taken and h in plain:
                run = _region(h, plain, succs, preds, remote, awaited, taken)
                taken.update(run)
                runs.append(run)
    else:
        run = []
        for w in kernels:
            last = run[-1] if run else None
            if not (
                last is not None
                and w in plain
                and w not in remote
                and last not in awaited
                and all(u in kernel_set for u in succs.get(last, ()))
            ):
                runs.append(run)
                run = []
                if w not in plain:
                    continue
            run.append(w)
        runs.append(run)
    chain_of: dict[int, tuple[int, ...]] = {}
    unit_preds: dict[int, tuple[int, ...]] = {}
    pos: dict[int, int] = {}
    for run in runs:
        if len(run) > 1:
            chain = tuple(run)
            here = {v: i for i, v in enumerate(run)}
            pos.update(here)
            for i, v in enumerate(run):
                chain_of[v] = chain
                unit_preds[v] = tuple(here[u] for u in preds.get(v, ()) if here.get(u, i) < i)
    return chain_of, unit_preds, pos
