"""The cuda backend's host threads: one loop that launches and completes every stream's
vertices, a waker per stream, a helper per stream for work that blocks the host.

TURNIP appendix A: a vertex is launched as asynchronous CUDA work on a stream, and the event loop
learns when the stream has executed it. Here one thread, the loop, drives every stream, as a CUDA
program's host thread does:
- it launches the submitted vertices in submission order: makes the vertex's stream wait on the
  end events of the vertices it waits on (`Stream.wait_event`: the device orders them, the host
  does not wait), records a start event, runs `work(vid, s)` with that stream current (kernels
  and cudaMemcpyAsync are only enqueued) and records the end event; a vertex behind one still in
  flight on its stream, with nothing to wait on (a chain launched ahead), starts when that one
  ends, so that end event is its start and it records only its own end;
- it finds completions itself, by querying the end event at the head of each stream (a stream
  runs its vertices in order), and calls `done`, so the executor's counters and its next
  submissions run on this thread too;
- only when nothing completed and nothing is left to launch does it sleep. Before that it arms
  one waker thread per stream with the end event at that stream's head; the waker blocks in
  `Event.synchronize` and wakes the loop. End events carry the blocking-sync flag
  (cudaEventBlockingSync), so a waker sleeps in the driver instead of spinning a core (without
  it, each armed waker busy-waits a CPU core, and up to one per stream starve the loop and Ray).
  The sleep itself is bounded (WAKE_S): a wake-up lost for any reason costs WAKE_S, never a hang.
A busy host thus makes no handoff between Python threads per vertex, and nothing contends for the
GIL with the launches; an idle one is woken as soon as a stream finishes. Its host cost per
vertex: docs/BENCHMARKS.md (benchmarks/bench_host.py, on the stand-in device).
Rejected: cupy's `launch_host_func` callbacks (43 us median on the H100, run on CUDA's one
callback thread for all streams, and may not call CUDA themselves) and polling the events on a
timer (a poll interval of latency).

Work that does not only enqueue (`actors.backends.base.Mode`):
- BLOCKING (a transfer whose bytes come through a Ray call): the stream's helper thread runs it
  (waits, start event, `work`, end event) and hands it back once recorded; meanwhile the loop
  launches nothing else on that stream, nor anything waiting on that vertex.
- DEFERRED (an NCCL receive): the loop runs `work`, which only registers the receive with the
  channel; the channel's thread later enqueues it through `external_begin` (waits, start
  event) and `external_end` (end event), in the communicator's order. The loop treats the
  vertex as a helper's until then.
Whatever a helper or the channel hits, the vertex comes back to the loop (`_recorded`), with its
error, so no thread's death holds a stream for ever.

Failures: an error of one vertex's launch (its waits, events, `work`, the launch path itself)
ends that vertex with it; an error of the loop outside any vertex (a bug, a broken device) ends
every vertex it holds, each exactly once (`_fail_in_hand`), and the loop goes on.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from threading import get_ident

import torch

from disco_ray.graph.errors import RunError

from .base import Done, Mode, Work

WAKE_S = 0.1  # longest the loop sleeps without looking at its streams


def new_events() -> tuple:
    """(start, end) of a vertex: both timed (its interval); the end one also blocking-sync, since
    wakers wait on it and other streams order themselves after it."""
    return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True))


class Clock:
    """Wall-clock times of device events: the host time of one synchronized base event plus the
    device's elapsed time since it (cudaEventElapsedTime, any two events of one device)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.base = torch.cuda.Event(enable_timing=True, blocking=True)
        self.base_ns = 0
        self.at = -1e18  # perf_counter of the last rebase
        self.rebase()

    def rebase(self, every_s: float = 0.5) -> None:
        if time.perf_counter() - self.at < every_s:
            return
        self.base.record(self.stream)
        self.base.synchronize()
        self.base_ns = time.time_ns()
        self.at = time.perf_counter()


class LoopState:
    """What the loop holds between passes (only the loop thread touches it)."""

    def __init__(self, streams: int, clock: Clock):
        self.waiting: collections.deque = collections.deque()  # (vid, s, waits, mode), not launched, in order
        self.held: dict[int, int] = {}  # vid -> stream: handed to a helper or the channel, not recorded
        self.held_on = [0] * streams  # per stream: how many of `held` are on it
        self.inflight: list[collections.deque] = [collections.deque() for _ in range(streams)]
        self.armed: list = [None] * streams  # per stream: the end event its waker was given
        self.last: list = [(None, 0)] * streams  # per stream: (end event, its time) of the last completed
        self.clock = clock


class CudaLoop:
    """The threads of one `CudaBackend.open`: the loop, a waker and a helper per stream."""

    def __init__(self, device: torch.device, streams: list, work: Work, done: Done, warm: Callable[[], None]):
        self.device, self.streams, self.work, self.done = device, streams, work, done
        n = len(streams)
        self.submitted: collections.deque = collections.deque()  # (vid, s, waits, mode); any thread
        # (vid, s, evs, exc, recorded) from helpers and the channel; recorded False: no end event
        self.recorded: collections.deque = collections.deque()
        self.wake = threading.Event()  # submitted, recorded, or an armed event completed
        self.stop = False
        self.events: dict[int, tuple] = {}  # vid -> (start, end), made once, kept across runs
        self.external: dict[int, tuple] = {}  # vid -> (s, waits, evs) of a DEFERRED vertex not enqueued yet
        self.arms: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(n)]
        self.helpers: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(n)]
        # [vertices launched, ns in `work`, ns asleep with vertices in flight, of the launched
        # those run by a helper or the channel]
        self.host = [0, 0, 0, 0]
        self.error: BaseException | None = None  # of the warm-up
        self._warm = warm
        self.ident: int | None = None  # the loop thread's
        self.st: LoopState  # the loop's own state, made on its thread
        self.current = -1  # the stream the loop last made current
        warmed = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(warmed,), daemon=True, name="cuda-loop")]
        # daemons: one stuck in a Ray call to a lost peer must not keep the process from exiting
        self.threads += [
            threading.Thread(target=self._waker, args=(s,), daemon=True, name=f"cuda-wait-{s}")
            for s in range(n)
        ]
        self.threads += [
            threading.Thread(target=self._helper, args=(s,), daemon=True, name=f"cuda-blocking-{s}")
            for s in range(n)
        ]
        for t in self.threads:
            t.start()
        if not warmed.wait(timeout=120) and self.error is None:
            self.error = RunError("the launch loop did not start within 120 s")

    # ---- the loop ----------------------------------------------------------------------------------
    def _loop(self, warmed: threading.Event) -> None:
        self.ident = get_ident()
        try:  # everything the loop needs, before `open` returns: an error here fails `open`
            torch.cuda.set_device(self.device)
            self._warm()  # in this thread: torch keeps a cuBLAS handle per thread
            st = self.st = LoopState(len(self.streams), Clock(self.streams[0]))
        except BaseException as e:  # e.g. out of memory
            self.error = e
            warmed.set()
            return
        warmed.set()
        wake, acc, ns = self.wake, self.host, time.perf_counter_ns
        while True:
            wake.clear()
            if self.stop:
                return
            try:
                if self._turn(st):
                    continue
            except BaseException as e:  # a CUDA error outside any vertex, or a bug: never hang
                self._fail_in_hand(st, e)
                continue
            if any(st.inflight):
                for s, fl in enumerate(st.inflight):  # wake me when a stream finishes its next vertex
                    if fl and st.armed[s] is not fl[0][2][1]:
                        st.armed[s] = fl[0][2][1]
                        self.arms[s].put(st.armed[s])
                t = ns()
                wake.wait(WAKE_S)
                acc[2] += ns() - t
            else:
                wake.wait(WAKE_S)

    def _turn(self, st: LoopState) -> bool:
        """One pass: completions, records handed back, launches. False: nothing happened."""
        busy = False
        done, clock, last = self.done, st.clock, st.last
        for s, fl in enumerate(st.inflight):  # completions: a stream runs its vertices in order
            while fl:
                vid, exc, evs = fl[0]
                try:
                    if not evs[1].query():
                        break
                    base, t = clock.base, clock.base_ns  # device times since the base event; a chain's:
                    t0 = last[s][1] if evs[0] is last[s][0] else t + int(base.elapsed_time(evs[0]) * 1e6)
                    last[s] = evs[1], (t1 := t + int(base.elapsed_time(evs[1]) * 1e6))
                except BaseException as e:  # an asynchronous CUDA error of this vertex's work
                    t0 = t1 = time.time_ns()
                    exc = exc or e
                fl.popleft()
                if st.armed[s] is evs[1]:  # its events come back in the next run
                    st.armed[s] = None
                busy = True
                done(vid, s, t0, t1, exc)  # may submit: appends to `submitted`
        recorded, submitted = self.recorded, self.submitted
        while recorded:
            vid, s, evs, exc, ok = recorded.popleft()
            del st.held[vid]
            st.held_on[s] -= 1
            busy = True
            if ok:
                st.inflight[s].append((vid, exc, evs))
            else:  # its end event was never recorded: nothing to wait for on the device
                t = time.time_ns()
                done(vid, s, t, t, exc or RunError(f"vertex {vid}: its end event was not recorded"))
        while submitted:
            st.waiting.append(submitted.popleft())
        if st.waiting:
            if not any(st.inflight) and not st.held:
                st.clock.rebase()  # idle: the device's clock against the host's, again
            busy = self._launch_waiting(st) > 0 or busy
        return busy

    def _launch_waiting(self, st: LoopState) -> int:
        """Launches, in order, every waiting vertex whose stream is free to take it and that waits
        on no vertex still held back; the others stay waiting, in order. Returns how many went.
        Each vertex leaves `waiting` before it is launched, so a failure never sees it twice."""
        blocked: set[int] = set()  # vids left waiting
        stalled: set[int] = set()  # streams with a vertex left waiting
        held, waiting = st.held, st.waiting
        launched = 0
        for _ in range(len(waiting)):
            item = waiting.popleft()
            vid, s, waits, mode = item
            # LAUNCH work goes on no stream a helper enqueues on; external work joins the others'
            busy = s in stalled or (st.held_on[s] and mode == Mode.LAUNCH)
            if busy or (waits and not (blocked.isdisjoint(waits) and held.keys().isdisjoint(waits))):
                waiting.append(item)
                blocked.add(vid)
                stalled.add(s)
                continue
            launched += 1
            if mode == Mode.LAUNCH:
                try:
                    vid, exc, evs = self._launch(vid, s, waits)
                except BaseException as e:  # a bug in the launch path: this vertex ends with it
                    exc, evs = e, None
                if evs is not None:
                    st.inflight[s].append((vid, exc, evs))
                else:  # nothing of it is on the device: it ends now (else its run never ends)
                    self.done(vid, s, (t := time.time_ns()), t, exc)
                continue
            held[vid] = s
            st.held_on[s] += 1
            self.host[0] += 1
            self.host[3] += 1
            if mode == Mode.BLOCKING:
                self.helpers[s].put((vid, waits))
            else:
                self._defer(vid, s, waits)
        return launched

    def _launch(self, vid: int, s: int, waits: tuple[int, ...]):
        """`_enqueue` from the loop, no context switch (hot); returns its in-flight record."""
        t0 = time.perf_counter_ns()
        exc: BaseException | None = None
        evs = self.events.get(vid) or self._events_of(vid)
        stream = self.streams[s]
        ahead = self.st.inflight[s]
        start = ahead[-1][2][1] if ahead and not waits else evs[0]  # behind a chain: its end
        try:
            if self.current != s:  # set_stream is not free: only when it changes
                torch.cuda.set_stream(stream)
                self.current = s
            try:
                for u in waits:
                    stream.wait_event(self.events[u][1])
                if start is evs[0]:
                    start.record(stream)
                self.work(vid, s)
            except BaseException as e:  # reported to the executor, which stops the run
                exc = e
            evs[1].record(stream)  # also after a failed `work`: the loop finds it done
        except BaseException as e:  # the end event itself: e.g. a sticky CUDA error
            exc, start = exc or e, None
        self.host[0] += 1
        self.host[1] += time.perf_counter_ns() - t0
        return vid, exc, None if start is None else (start, evs[1])  # events None: end not recorded

    def _enqueue(self, vid: int, s: int, waits: tuple[int, ...]):
        """On stream `s`, from a helper: waits, start event, `work`, end event. Never raises:
        returns (the exception of the vertex or None, its events, whether its end event is
        recorded)."""
        exc: BaseException | None = None
        evs = None
        try:
            evs = self._events_of(vid)
            stream = self.streams[s]
            try:
                for u in waits:
                    stream.wait_event(self.events[u][1])
                evs[0].record(stream)
                with torch.cuda.stream(stream):
                    self.work(vid, s)
            except BaseException as e:  # reported to the executor, which stops the run
                exc = e
            evs[1].record(stream)  # also after a failed `work`: the loop finds it done
            return exc, evs, True
        except BaseException as e:  # the end event itself: e.g. a sticky CUDA error
            return exc or e, evs, False

    def _events_of(self, vid: int) -> tuple:
        evs = self.events.get(vid)
        return evs if evs is not None else self.events.setdefault(vid, new_events())

    def _defer(self, vid: int, s: int, waits: tuple[int, ...]) -> None:
        """A DEFERRED vertex: `work` registers it with whoever enqueues it later."""
        try:
            self.external[vid] = (s, waits, self._events_of(vid))
            self.work(vid, s)
        except BaseException as e:
            self.external.pop(vid, None)
            self.recorded.append((vid, s, None, e, False))

    def _fail_in_hand(self, st: LoopState, err: BaseException) -> None:
        """Every vertex the loop holds (waiting, in flight; not one a helper or the channel has)
        ends with `err`, each once: they leave `waiting` and `inflight` before `done` runs."""
        e = RunError(f"backend 'cuda' on {self.device}: the launch loop failed: {type(err).__name__}: {err}")
        t = time.time_ns()
        items = []
        while st.waiting:
            vid, s, _, _ = st.waiting.popleft()
            items.append((vid, s))
        for s, fl in enumerate(st.inflight):
            while fl:
                items.append((fl.popleft()[0], s))
            st.armed[s] = None
        for vid, s in items:
            with contextlib.suppress(BaseException):
                self.done(vid, s, t, t, e)

    # ---- helpers, the channel's hooks, wakers -------------------------------------------------------
    def _helper(self, s: int) -> None:
        """Runs the BLOCKING vertices of stream `s`, which the loop holds meanwhile, and hands each
        back once recorded. Never dies of a vertex: whatever happens, the vertex goes back."""
        get = self.helpers[s].get
        with contextlib.suppress(BaseException):
            torch.cuda.set_device(self.device)
        while (item := get()) is not None:
            vid, waits = item
            exc, evs, ok = self._enqueue(vid, s, waits)
            self.recorded.append((vid, s, evs, exc, ok))
            self.wake.set()

    def external_begin(self, vid: int):
        """From the thread that enqueues a DEFERRED vertex (the NCCL channel): its stream waits on
        its waits and records its start event. Returns the stream to enqueue the work on."""
        s, waits, evs = self.external[vid]
        stream = self.streams[s]
        for u in waits:
            stream.wait_event(self.events[u][1])
        evs[0].record(stream)
        return stream

    def external_end(self, vid: int, exc: BaseException | None = None) -> None:
        """The DEFERRED vertex's work is enqueued (or failed: `exc`): its end event is recorded
        and the vertex goes back to the loop."""
        s, _, evs = self.external.pop(vid)
        ok = False
        try:
            evs[1].record(self.streams[s])
            ok = True
        except BaseException as e:
            exc = exc or e
        self.recorded.append((vid, s, evs, exc, ok))
        self.wake.set()

    def _waker(self, s: int) -> None:
        """Wakes the sleeping loop when stream `s` finishes the vertex the loop armed it with."""
        get, wake = self.arms[s].get, self.wake
        with contextlib.suppress(BaseException):
            torch.cuda.set_device(self.device)
        while True:
            end = get()
            if end is None:
                return
            with contextlib.suppress(BaseException):  # the loop's query reports the error
                end.synchronize()  # blocking-sync event: this thread sleeps, the GIL released
            wake.set()

    def submit(self, s: int, vid: int, waits: tuple[int, ...] = (), mode: Mode = Mode.LAUNCH) -> None:
        # the executor submits under its lock, lowest id first: this deque holds its order
        self.submitted.append((vid, s, waits, mode))
        if get_ident() != self.ident:  # from the loop (in `done`) it runs its next pass anyway
            self.wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the threads, waiting `timeout_s` in all for them: a waker asleep on work that
        never ends (a peer lost mid-transfer) or a helper stuck in a Ray call is left behind (a
        daemon) rather than holding the caller."""
        self.stop = True
        self.wake.set()
        for q in self.arms + self.helpers:
            q.put(None)
        t_end = time.monotonic() + timeout_s
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, t_end - time.monotonic()))
