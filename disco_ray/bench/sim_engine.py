"""The simulated engine: the runtime's own cores on a simulated clock (an event heap).

Like the `local` engine (`disco_ray.driver.engine_local`) it drives the coordinator's core
(`actors.scheduler.Scheduler`) and, per GPU, the worker's core and stream slots
(`actors.worker_core.WorkerCore`, `actors.slots.StreamSlots`), its lanes (`actors.lanes`) and its reporter's
decision (`actors.reporter.Reporter`); where that engine has threads, a backend and wall-clock
time, this one has an event heap and a device model:

- a stream runs what was submitted to it one at a time, in submission order, each vertex once
  the vertices it waits on (`StreamSlots.take`'s waits) have landed;
- a vertex occupies its engine (the Route of its stream: compute, h2d, d2h, peer, disk_w,
  disk_r) for its duration; with `overlap` False an engine runs one vertex at a time, the head
  submitted first going next (a profiled kernel's time assumes the whole GPU); with `overlap`
  every stream runs on its own (measured durations already include the sharing);
- `Host` gives the host's costs: a completion's own host time (the executor's `_done`, which
  holds its stream, as the cpu backend's stream thread does), the time an idle stream's thread
  takes to start work another thread handed it, the reporter's `flush_s`, whose loop
  (`actors.reporter.ReportThread`) is replayed pass by pass, and the host time of its report
  call; with all 0 every completion reaches the coordinator at once and every launch starts at
  once (the papers' ideal event loop).

So a change to the runtime's policy (the lane rule, copy depth, launch ahead, the ready order,
the reporter's lag) changes the simulated schedule. Alternatives rejected: a scheduler of the
simulator's own (it drifts from the runtime's without any test noticing) and running the real
executor with sleeping kernels (wall-clock time, not reproducible).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from actors.backends.base import Mode
from actors.lanes import Lanes, Route
from actors.reporter import Reporter
from actors.scheduler import Abort, Completed, Dispatch, Instruction, Scheduler
from actors.slots import StreamSlots
from actors.worker_core import WorkerCore
from disco_ray.graph.errors import GraphError
from disco_ray.graph.memgraph import MemGraph

# device done, completion handled, reporter's pass, stream thread up, report sent
_END, _LANDED, _TICK, _WAKE, _SENT = range(5)


@dataclass(frozen=True, slots=True)
class Host:
    """The host side of the simulated runtime, in the cost model's time unit (all 0: ideal)."""

    done_s: float = 0.0  # host time of each completion; its stream waits meanwhile
    wake_s: float = (
        0.0  # an idle thread (a stream's, the reporter's), handed work by another, starts it this late
    )
    # the reporter's period while its worker is busy: flush_s (WorkerConfig) and the host's
    # oversleep; 0: every completion reaches the coordinator at once
    flush_s: float = 0.0
    lazy_s: float = 0.05  # the reporter's lazy_s (WorkerConfig)
    # host time of one report (the coordinator's handling, the dispatch): the batch reaches the
    # coordinator this late, and the reporter's next pass is as much later
    report_s: float = 0.0


class _Worker:
    """One GPU: its runtime cores, and its streams' queues on the simulated device."""

    def __init__(self, mg: MemGraph, gpu: int, streams: int, ahead: int, host: Host, mode_of):
        self.gpu = gpu
        self.lanes = lanes = Lanes.of(mg, gpu, streams)
        self.core = WorkerCore(mg, gpu, streams)
        self.slots = StreamSlots(self.core, streams, lanes.limits)
        lane_of, modes = lanes.assign((v for v in mg.vertices if v.gpu == gpu), mode_of)
        self.slots.start(ahead, lane_of, modes)  # as the executor: nothing ahead behind a non-LAUNCH vertex
        self.engine = [lanes.engine(s) for s in range(lanes.total)]
        self.engine_no = [list(Route).index(e) for e in self.engine]  # (an int: hashed per start)
        # per stream: (submission number, vertex, waits, not before)
        self.queue: list[deque[tuple[int, int, tuple[int, ...], float]]] = [deque() for _ in self.engine]
        self.occupied = [False] * lanes.total  # the stream runs a vertex (or its completion)
        self.engine_busy = [0] * len(Route)  # vertices running per engine
        self.reporter = Reporter(host.flush_s, host.lazy_s)
        self.looping = False  # the reporter thread is in its busy loop
        self.woken = False  # a completion arrived during that loop
        self.sending: deque[list[int]] = deque()  # batches in a report call (`Host.report_s`)


class SimEngine:
    """Runs one MemGraph on the simulated clock; `run` returns each vertex's (stream, start, end)."""

    def __init__(
        self,
        mg: MemGraph,
        duration: Mapping[int, float],
        streams: int,
        ahead: int,
        host: Host = Host(),
        overlap: bool = False,
        mode_of: Callable[[int], Mode] = lambda src: Mode.LAUNCH,
    ):
        """`duration`: vertex id -> time it occupies its engine; `mode_of(src_gpu)`: how a pull
        from that GPU behaves (the transport's `mode`; LAUNCH: a peer copy)."""
        self.mg, self.dur, self.host, self.overlap = mg, duration, host, overlap
        self.sched = Scheduler(mg)
        self.workers = [_Worker(mg, g, streams, ahead, host, mode_of) for g in range(mg.gpus)]
        self.heap: list[tuple[float, int, int, int, int, int]] = []  # (time, seq, kind, gpu, vid, stream)
        self.seq = 0
        self.now = 0.0
        self.span: dict[int, tuple[int, float, float]] = {}  # vid -> (stream, start, end)
        self.landed: set[int] = set()

    def run(self) -> dict[int, tuple[int, float, float]]:
        """Simulates the run; GraphError if it deadlocks (a cycle)."""
        self._apply(self.sched.start())
        while self.heap:
            t, _, kind, g, vid, s = heapq.heappop(self.heap)
            self.now = t
            w = self.workers[g]
            if kind == _END:
                self._end(w, vid, s)
            elif kind == _LANDED:
                self._land(w, vid, s)
            elif kind == _TICK:
                self._tick(w)
            elif kind == _SENT:
                self._apply(self.sched.handle(Completed(w.gpu, w.sending.popleft())))
            else:
                self._start(w)
        if len(self.landed) != self.sched.n:
            stuck = min(v.id for v in self.mg.vertices if v.id not in self.landed)
            raise GraphError(
                f"simulation deadlocked: vertex {stuck} never became ready "
                f"({len(self.landed)} of {self.sched.n} vertices ran; the MemGraph has a cycle)"
            )
        return self.span

    def _push(self, t: float, kind: int, w: _Worker, vid: int = -1, s: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, w.gpu, vid, s))

    def _apply(self, instrs: list[Instruction]) -> None:
        for i in instrs:
            if isinstance(i, Dispatch):
                w = self.workers[i.gpu]
                w.core.dispatch(i.vids)
                self._pump(w, -1)
            elif isinstance(i, Abort):
                raise GraphError(f"simulation aborted: {i.message}")

    def _pump(self, w: _Worker, by: int) -> None:
        """The executor's `_pump` on the thread of stream `by` (-1: another thread): what the
        stream slots launch goes to its stream's queue."""
        for vid, s, waits in w.slots.take():
            self.seq += 1
            t = self.now
            if s != by and not w.queue[s] and not w.occupied[s] and self.host.wake_s > 0:
                t += self.host.wake_s  # its thread sleeps: it must be woken
                self._push(t, _WAKE, w)
            w.queue[s].append((self.seq, vid, waits, t))
        self._start(w)

    def _start(self, w: _Worker) -> None:
        """Starts every stream head that may run now, the one submitted first first."""
        while True:
            best = -1
            for s, q in enumerate(w.queue):
                if not q or w.occupied[s] or q[0][3] > self.now or any(u not in self.landed for u in q[0][2]):
                    continue
                if not self.overlap and w.engine_busy[w.engine_no[s]]:
                    continue
                if best < 0 or q[0][0] < w.queue[best][0][0]:
                    best = s
            if best < 0:
                return
            vid = w.queue[best].popleft()[1]
            w.occupied[best] = True
            w.engine_busy[w.engine_no[best]] += 1
            end = self.now + self.dur[vid]
            self.span[vid] = (best, self.now, end)
            self._push(end, _END, w, vid, best)

    def _end(self, w: _Worker, vid: int, s: int) -> None:
        """The device finished `vid`: its engine frees; its completion is handled `done_s` later."""
        w.engine_busy[w.engine_no[s]] -= 1
        if self.host.done_s > 0:
            self._push(self.now + self.host.done_s, _LANDED, w, vid, s)
            self._start(w)
        else:
            self._land(w, vid, s)

    def _land(self, w: _Worker, vid: int, s: int) -> None:
        """The executor's `_done`: counters, stream slots, launches, then the report."""
        w.occupied[s] = False
        self.landed.add(vid)
        w.core.complete(vid)
        w.slots.landed(vid, s)
        self._pump(w, s)
        if self.host.flush_s <= 0:
            self._apply(self.sched.handle(Completed(w.gpu, (vid,))))
            return
        w.reporter.completed(vid, vid in w.core.awaited)
        if w.looping:
            w.woken = True
        else:  # its thread sleeps: it must be woken
            w.looping, w.woken = True, False
            self._push(self.now + self.host.wake_s, _TICK, w)

    def _tick(self, w: _Worker) -> None:
        """One pass of the reporter thread's loop (`actors.reporter.ReportThread._loop`)."""
        busy = w.slots.running > 0
        batch = w.reporter.take(self.now, busy)
        after = self.now  # the pass's end: the report call returned
        if batch is not None and self.host.report_s > 0:
            after += self.host.report_s
            w.sending.append(batch)
            self._push(after, _SENT, w)
        elif batch is not None:
            self._apply(self.sched.handle(Completed(w.gpu, batch)))
        if busy:
            self._push(after + self.host.flush_s, _TICK, w)  # it sleeps flush_s
        elif w.woken:  # woken during the loop: it passes once more at once
            w.woken = False
            self._push(after, _TICK, w)
        else:
            w.looping = False

    def statistics(self) -> dict:
        return {
            "scheduler": self.sched.statistics(),
            "launched_ahead": sum(w.slots.launched_ahead for w in self.workers),
            "reports": sum(w.reporter.reports for w in self.workers),
        }
