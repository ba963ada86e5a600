"""Which vertex goes to which of a worker's streams, and when (pure): `StreamSlots`, over the
worker's dependency core (`actors.worker_core.WorkerCore`), driven by `actors.executor`.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Mapping, Sequence

from disco_ray.graph.errors import RunError

from .worker_core import WorkerCore


class StreamSlots:
    """Which vertex goes to which of a worker's streams, and when (pure; the executor holds its
    lock around every call).

    Streams 0..S-1 run kernels; the streams after them are lanes, each for one kind of copy
    (`lane_of`: host-to-device loads, device-to-host offloads, the transfers from one peer). A
    ready copy goes to its lane at once, up to that lane's limit of vertices in flight (None: no
    limit), whatever the kernels do: copies are what offload overlap lives on, so a kernel chain
    launched ahead never holds a load back (it did when copies took a free compute stream).

    A ready kernel goes to a compute stream with nothing in flight, the one freed last first (a
    chain on one worker stays on its thread); with launch ahead, when none is free, behind the
    least busy stream with room, as the lowest id among the kernels to place. With launch ahead (`start(ahead)`, ahead > 0) a
    queued kernel (see `WorkerCore`) goes to the compute stream of its most recently launched
    running predecessor there, up to `ahead` vertices behind the one that stream runs (or, when
    its running predecessors are all copies on lanes, to the least busy compute stream with room),
    and waits on its running predecessors on other streams (the stream itself orders those on
    it). Each queued kernel's stream is chosen once and kept in a heap, so `take` costs per
    launch, not per queued kernel.
    """

    def __init__(self, core: WorkerCore, streams: int, lane_limits: Sequence[int | None] = ()):
        self.core, self.streams = core, streams
        self.lane_limits = tuple(lane_limits)
        self.total = streams + len(self.lane_limits)
        self._lanes_given: Mapping[int, int] | None = None  # the lane table `start` last checked
        self.start(0)

    def start(
        self,
        ahead: int,
        lane_of: Mapping[int, int] | None = None,
        aside: Container[int] = frozenset(),
        chained: bool = False,
    ) -> None:
        """A new run; `lane_of`: vertex -> the lane (a stream index >= S) it runs on; `aside`:
        vertices whose work another thread enqueues (`WorkerCore.start`); `chained`: a kernel
        launched takes the members of its chain that may follow it as one unit
        (`WorkerCore.claim`; `units`)."""
        self.ahead = ahead
        self.chained_units = chained
        self.units: dict[int, tuple[int, ...]] = {}  # a unit's first vertex -> its vertices, in flight
        self.held: dict[int, tuple[int, ...]] = {}  # the same, with launch ahead, until it lands
        self.head_of: dict[int, int] = {}  # with launch ahead: a unit's later vertex -> its first
        self.chained = [0, 0]  # this run's units and the vertices they held
        if lane_of is None or lane_of is not self._lanes_given:
            # checked once per table (the executor keeps one per plan), not at every run
            self.lane_of = dict(lane_of or {})
            for v, lane in self.lane_of.items():
                if not self.streams <= lane < self.total:
                    raise RunError(
                        f"vertex {v} was given lane {lane}; lanes are {self.streams}..{self.total - 1}"
                    )
            self._lanes_given = lane_of
        self.core.start(ahead > 0, aside)
        self.free = list(range(self.streams - 1, -1, -1))  # nothing in flight; pop() takes stream 0 first
        self.depth = [0] * self.total  # vertices in flight per stream
        self.inflight: dict[int, tuple[int, int]] = {}  # vid -> (launch number, stream), with ahead
        self.ready_kernels: list[int] = []  # heap: ready, waiting for a free compute stream
        self.ready_lanes: list[list[int]] = [[] for _ in self.lane_limits]  # heaps: ready copies
        # with ahead: queued kernels by the compute stream they go behind (heaps of ids), chosen
        # once; `anywhere`: those whose running predecessors are all on lanes
        self.behind: list[list[int]] = [[] for _ in range(self.streams)]
        self.anywhere: list[int] = []
        self.launches = 0
        self.launched_ahead = 0  # this run's vertices launched behind running predecessors
        self.running = 0

    def take(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """What to launch now, in order: (vertex, stream, vertices on other streams to wait on)."""
        core, out, lane_of, base = self.core, [], self.lane_of, self.streams
        while core.ready:  # sort the newly ready: copies by lane, kernels aside
            vid = heapq.heappop(core.ready)
            lane = lane_of.get(vid)
            heapq.heappush(self.ready_kernels if lane is None else self.ready_lanes[lane - base], vid)
        for i, h in enumerate(self.ready_lanes):
            s, limit = base + i, self.lane_limits[i]
            while h and (limit is None or self.depth[s] < limit):
                out.append(self._launch(heapq.heappop(h), s, ()))
        if self.ahead:
            self._take_ahead(out)
        else:
            free = self.free
            while free and self.ready_kernels:
                out.append(self._launch(heapq.heappop(self.ready_kernels), free.pop(), ()))
        out.sort()  # the lowest id first: the loop launches in this order
        return out

    def _take_ahead(self, out: list) -> None:
        """With launch ahead: kernels, ready or queued, the lowest id first, while a compute stream
        has room for it. A ready kernel takes a free stream, or else goes behind the least busy
        one: were streams kept for queued chains until one ran dry, a ready kernel of a low id
        would wait for those chains to end (after 15 of 17 completions in the stand-in's case).
        Hot (once per completion): no helper calls in the scan."""
        core, limit, depth, inflight = self.core, self.ahead + 1, self.depth, self.inflight
        left, launched, preds, ready = core.left, core.launched, core.local_preds, self.ready_kernels
        behind, anywhere, streams = self.behind, self.anywhere, range(self.streams)
        head_of = self.head_of
        while True:
            if core.queued:
                self._sort_queued()
            vid, s, h = -1, -1, None  # the lowest candidate id, its stream, its heap
            for t in streams:
                q = behind[t]
                if q and depth[t] < limit:
                    while q and (q[0] in launched or not left[q[0]]):  # launched, or ready: served as ready
                        heapq.heappop(q)
                    if q and (vid < 0 or q[0] < vid):
                        vid, s, h = q[0], t, q
            while anywhere and (anywhere[0] in launched or not left[anywhere[0]]):
                heapq.heappop(anywhere)
            for q in (anywhere, ready):
                if q and (vid < 0 or q[0] < vid):
                    t = min(streams, key=depth.__getitem__)  # the least busy
                    if depth[t] < limit:
                        vid, s, h = q[0], t, q
            if h is None:
                return
            heapq.heappop(h)
            if h is ready:
                out.append(self._launch(vid, self._free_stream() if depth[s] == 0 else s, ()))
                continue
            self.launched_ahead += 1
            waits: tuple[int, ...] = ()
            for u in preds[vid]:  # a loop, not a generator: no call per kernel
                if u in inflight and inflight[u][1] != s:
                    u = head_of.get(u, u)  # a unit's vertex ends with the unit: its first's event
                    if u not in waits:
                        waits += (u,)
            out.append(self._launch(vid, s, waits))

    def _free_stream(self) -> int:
        """The free compute stream freed last (some is free); `free` may also hold streams that
        took a kernel launched ahead since they were freed: those are dropped here."""
        free, depth = self.free, self.depth
        while depth[free[-1]]:
            free.pop()
        return free.pop()

    def _sort_queued(self) -> None:
        """Moves newly queued kernels to the heap of the compute stream of their most recently
        launched running predecessor there: behind it, they wait on no vertex of that stream
        (`WorkerCore.pop_queued`, inline: once per completion)."""
        core, inflight, base = self.core, self.inflight, self.streams
        q, launched, left = core.queued, core.launched, core.left
        while q:
            vid = heapq.heappop(q)
            if vid in launched or not left[vid]:
                continue
            last = None  # its most recently launched running predecessor on a compute stream
            for u in core.local_preds[vid]:
                at = inflight.get(u)
                if at is not None and at[1] < base and (last is None or at > last):
                    last = at
            heapq.heappush(self.behind[last[1]] if last else self.anywhere, vid)

    def _launch(self, vid: int, s: int, waits: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        self.running += 1
        self.depth[s] += 1
        core = self.core
        unit = None
        if self.chained_units and vid in core.chain_of:  # before its successors queue behind it alone
            unit = core.claim(vid, self.inflight if self.ahead else None, s)
            if len(unit) > 1:
                self.units[vid] = unit
                self.chained[0] += 1
                self.chained[1] += len(unit)
            else:
                unit = None
        if self.ahead:
            self.launches += 1
            self.inflight[vid] = (self.launches, s)  # a unit's later vertices: on the same stream
            core.launch(vid)
            if unit is not None:  # what follows the unit may queue behind it, waiting on the unit
                self.held[vid] = unit
                at = self.inflight[vid]
                for m in unit[1:]:
                    self.inflight[m] = at
                    self.head_of[m] = vid
                    core.launch(m)
        return vid, s, waits

    def landed(self, vid: int, s: int) -> None:
        """`vid` left stream `s` (done or failed)."""
        if self.ahead:
            del self.inflight[vid]
            unit = self.held.pop(vid, None) if self.held else None
            if unit is not None:
                for m in unit[1:]:
                    del self.inflight[m]
                    del self.head_of[m]
        d = self.depth[s] - 1
        self.depth[s] = d
        if d == 0 and s < self.streams:
            self.free.append(s)
        self.running -= 1
