"""The CUDA backend: one arena on the GPU, one pinned host store, S CUDA streams, one host thread.

TURNIP appendix A: a vertex is launched as asynchronous CUDA work on a stream, and the event loop
learns when the stream has executed it. Here one thread, the loop, drives every stream, as a CUDA
program's host thread does:
- it launches the submitted vertices in submission order: makes the vertex's stream wait on the
  end events of the vertices it waits on (`Stream.wait_event`: the device orders them, the host
  does not wait), records a start event, runs `work(vid, s)` with that stream current (kernels
  and cudaMemcpyAsync are only enqueued) and records the end event;
- it finds completions itself, by querying the end event at the head of each stream (a stream
  runs its vertices in order), and calls `done`, so the executor's counters and its next
  submissions run on this thread too;
- only when nothing completed and nothing is left to launch does it sleep. Before that it arms
  one waker thread per stream with the end event at that stream's head; the waker blocks in
  `Event.synchronize` (the GIL released) and wakes the loop.
A busy host thus makes no handoff between Python threads per vertex, and nothing contends for the
GIL with the launches; an idle one is woken as soon as a stream finishes. Measured with kernels
on the CPU behind the same threads (the stand-in device of tests/fake_cuda.py,
benchmarks/bench_host.py; CPU figures): a launcher and a waiter thread per stream, the earlier
design, cost 105-227 us per vertex of the llama graph above its kernels' own host time; the loop
costs 1-19 us (docs/RUNTIME.md). With the executor's launch ahead (see `actors.executor`) the
loop prepares the next kernels of a chain while the device runs the current one.
Rejected: cupy's `launch_host_func` callbacks (43 us median on the H100, run on CUDA's one
callback thread for all streams, and may not call CUDA themselves) and polling the events on a
timer (a poll interval of latency).

A vertex whose work blocks the host (`submit(..., blocking=True)`: a transfer over NCCL, whose
source is asked for its send by a Ray call, or over the Ray object store) is not run on the loop:
that stream's helper thread runs it while the loop holds that stream (launches nothing else on
it, nor anything waiting on that vertex) until the helper has recorded its end event; the other
streams go on.

Host-device copies go through two FIFO copy lanes (one stream per direction), not the vertex's
own stream: the vertex's stream waits on the lane after its copy, so completion is still one
event. The loop launches in submission order (the executor submits lowest id first, i.e. the
planner's order), so copies enter the lanes in that order. Measured on the H100
(bench_gpu_chain): loads issued on several streams run concurrently and share PCIe, so each
finishes late and the matmul waiting for the first one starts late (1.26x the lower bound for
the weight-streaming chain); in launch order the first load gets all the bandwidth, as in a
hand-written prefetch loop.

Times: the interval of a vertex is measured on the GPU (two timing events around its work, the
start one recorded after the waits; for a lane copy the start event is recorded on the lane, so
time spent queued behind earlier copies is not counted as busy); its end is the wall-clock
instant the waiter returned, its start that minus the GPU interval. The events are made once per
vertex (the first time it runs) and kept for later runs. `statistics()["host"]` sums, since
`open`, the host time spent in `work` per vertex and the time the loop slept with vertices in
flight: a mean launch time above the device time of a vertex, with little idle time, means the
host, not the GPU, sets the pace.

Nothing is allocated while a graph runs: the arena and host store come once from `alloc`, graph
inputs are staged once per run into a pinned buffer before it starts (`stages_inputs`, see
`actors.executor`), and `open` creates cuBLAS's per-stream workspace (a warm-up matmul) and
leaves `workspace` bytes (DISCO_CUDA_WORKSPACE, default 16 MiB) plus one small-block segment
cached in torch's allocator for each stream: kernel temporaries (e.g. rmsnorm's float32 copy)
are carved from those, since the caching allocator keeps blocks per stream. A kernel whose
temporaries exceed that still works, at the cost of one cudaMalloc the first time.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
from collections.abc import Mapping

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.kernels import IMPLS

from .backend import Done, Work

_WARM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CudaBackend:
    """Arena on `device` (default: the current CUDA device), pinned host store, S CUDA streams."""

    name = "cuda"
    stages_inputs = True  # the executor copies graph inputs into a pinned buffer from `alloc`
    async_launch = True  # `work` only enqueues: it has not run when it returns
    default_ahead = 4  # the host prepares the next kernels of a chain while the device runs

    def __init__(self, device: int | str | torch.device | None = None, workspace: int | None = None):
        if not torch.cuda.is_available():
            raise RunError("backend 'cuda': torch sees no CUDA device")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        self.workspace = (
            int(os.environ.get("DISCO_CUDA_WORKSPACE", 16 << 20)) if workspace is None else workspace
        )
        self.streams: list[torch.cuda.Stream] = []
        self.h2d: torch.cuda.Stream | None = None  # the copy lanes
        self.d2h: torch.cuda.Stream | None = None
        self._local = threading.local()  # per launching thread: the vertex's lane start event
        # (vid, stream, waits, blocking) in submission order; appended by any thread
        self._submitted: collections.deque = collections.deque()
        # (vid, stream, evs, lane_used, exc) from the helpers once a blocking vertex is recorded
        self._recorded: collections.deque = collections.deque()
        self._wake = threading.Event()  # submitted, recorded, or an armed event completed
        self._stop = False
        self._arms: list[queue.SimpleQueue] = []  # per stream: an end event for its waker
        self._threads: list[threading.Thread] = []
        self._helpers: list[queue.SimpleQueue] = []  # per stream: the blocking vertex to run
        self._events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]] = {}
        # [vertices launched, ns in `work`, ns the loop slept with vertices in flight, of the
        # vertices launched those run by a helper]
        self._host = [0, 0, 0, 0]
        self.allocated = {"device": 0, "pinned": 0}

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        """One uint8 buffer: pinned host memory (host=True) or device memory; once per worker."""
        if host:
            self.allocated["pinned"] += nbytes
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=nbytes > 0)
        self.allocated["device"] += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def open(self, streams: int, work: Work, done: Done) -> None:
        self.close()
        with torch.cuda.device(self.device):
            self.streams = [torch.cuda.Stream(self.device) for _ in range(streams)]
            self.h2d, self.d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        self._submitted.clear()
        self._recorded.clear()
        self._stop = False
        self._arms = [queue.SimpleQueue() for _ in range(streams)]
        self._host = [0, 0, 0, 0]
        # a helper per stream runs its blocking vertices (daemons: one stuck in a Ray call to a
        # lost peer must not keep the process from exiting)
        self._helpers = [queue.SimpleQueue() for _ in range(streams)]
        self._warm_error: BaseException | None = None
        warmed = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(work, done, warmed), daemon=True, name="cuda-loop")
        ]
        self._threads += [
            threading.Thread(target=self._waker, args=(s,), daemon=True, name=f"cuda-wait-{s}")
            for s in range(streams)
        ]
        self._threads += [
            threading.Thread(target=self._helper, args=(s, work), daemon=True, name=f"cuda-blocking-{s}")
            for s in range(streams)
        ]
        for t in self._threads:
            t.start()
        warmed.wait(timeout=120)  # the loop has every stream's cuBLAS handle and workspace
        torch.cuda.synchronize(self.device)
        if self._warm_error is not None:
            err = self._warm_error
            self.close()
            raise RunError(f"backend 'cuda' on {self.device}: warming up the streams failed: {err}")

    # ---- the loop: launches, completions ---------------------------------------------------------
    def _loop(self, work: Work, done: Done, warmed: threading.Event) -> None:
        torch.cuda.set_device(self.device)
        # in this thread: torch keeps a cuBLAS handle per thread and its workspace per (handle, stream)
        try:
            for stream in self.streams:
                _warm(stream, self.device, self.workspace)
        except BaseException as e:  # e.g. out of memory: `open` raises it
            self._warm_error = e
        warmed.set()
        st = _LoopState(len(self.streams), _Clock(self.streams[0]))
        wake, acc, ns = self._wake, self._host, time.perf_counter_ns
        while True:
            wake.clear()
            if self._stop:
                return
            try:
                if self._turn(st, work, done):
                    continue
            except BaseException as e:  # a CUDA error outside any vertex, or a bug: never hang
                self._fail_in_hand(st, done, e)
                continue
            if any(st.inflight):
                for s, fl in enumerate(st.inflight):  # wake me when a stream finishes its next vertex
                    if fl and st.armed[s] is not fl[0][2][1]:
                        st.armed[s] = fl[0][2][1]
                        self._arms[s].put(st.armed[s])
                t = ns()
                wake.wait()
                acc[2] += ns() - t
            else:
                wake.wait()

    def _turn(self, st: _LoopState, work: Work, done: Done) -> bool:
        """One pass: completions, helpers' records, launches. False: nothing happened, nothing new."""
        busy = False
        for s, fl in enumerate(st.inflight):  # completions: a stream runs its vertices in order
            while fl:
                vid, exc, evs, lane_used = fl[0]
                try:
                    if not evs[1].query():
                        break
                    t0, t1 = st.clock.interval(evs[2] if lane_used else evs[0], evs[1])
                except BaseException as e:  # an asynchronous CUDA error of this vertex's work
                    t0 = t1 = time.time_ns()
                    exc = exc or e
                fl.popleft()
                if st.armed[s] is evs[1]:  # its events come back in the next run
                    st.armed[s] = None
                busy = True
                done(vid, s, t0, t1, exc)  # may submit: appends to `_submitted`
        recorded, submitted = self._recorded, self._submitted
        while recorded:
            vid, s, evs, lane_used, exc = recorded.popleft()
            del st.held[s]
            st.inflight[s].append((vid, exc, evs, lane_used))
            busy = True
        while submitted:
            st.waiting.append(submitted.popleft())
        if st.waiting:
            if not any(st.inflight) and not st.held:
                st.clock.rebase()  # idle: the device's clock against the host's, again
            st.waiting, launched = self._launch_waiting(st.waiting, st.held, st.inflight, work)
            busy = busy or launched > 0
        return busy or bool(submitted) or bool(recorded)

    def _fail_in_hand(self, st: _LoopState, done: Done, err: BaseException) -> None:
        """Every vertex the loop holds (waiting, in flight; not one a helper runs) ends with `err`."""
        e = RunError(f"backend 'cuda' on {self.device}: the launch loop failed: {type(err).__name__}: {err}")
        t = time.time_ns()
        items = [(vid, s) for vid, s, _, _ in st.waiting]
        items += [(rec[0], s) for s, fl in enumerate(st.inflight) for rec in fl]
        st.waiting.clear()
        for fl in st.inflight:
            fl.clear()
        for vid, s in items:
            with contextlib.suppress(BaseException):
                done(vid, s, t, t, e)

    def _launch_waiting(self, waiting: collections.deque, held: dict[int, int], inflight: list, work: Work):
        """Launches, in order, every waiting vertex whose stream is free of a blocking vertex and
        that waits on no vertex still held back; returns (those left, in order; number launched)."""
        left: collections.deque = collections.deque()
        blocked: set[int] = set()  # vids left waiting
        stalled: set[int] = set()  # streams with a vertex left waiting
        held_vids = set(held.values())
        launched = 0
        for item in waiting:
            vid, s, waits, blocking = item
            if s in held or s in stalled or any(u in blocked or u in held_vids for u in waits):
                left.append(item)
                blocked.add(vid)
                stalled.add(s)
                continue
            launched += 1
            if blocking:  # its waits are all recorded: the helper may enqueue them
                held[s] = vid
                held_vids.add(vid)
                self._host[0] += 1
                self._host[3] += 1
                self._helpers[s].put((vid, waits, self._events_of(vid)))
            else:
                inflight[s].append(self._launch(vid, s, waits, work))
        return left, launched

    def _events_of(self, vid: int):
        evs = self._events.get(vid)
        if evs is None:
            evs = self._events[vid] = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        return evs

    def _launch(self, vid: int, s: int, waits: tuple[int, ...], work: Work):
        """Enqueues vertex `vid` on stream `s` from the loop; returns its in-flight record."""
        evs = self._events_of(vid)
        t0 = time.perf_counter_ns()
        torch.cuda.set_stream(self.streams[s])
        exc, lane_used = self._enqueue(vid, s, waits, evs, work)
        self._host[0] += 1
        self._host[1] += time.perf_counter_ns() - t0
        return vid, exc, evs, lane_used

    def _enqueue(self, vid: int, s: int, waits: tuple[int, ...], evs, work: Work):
        """On stream `s` (current): waits, start event, `work`, end event; (exception, lane used)."""
        stream, local = self.streams[s], self._local
        start, end, local.lane_start = evs
        local.lane_used = False
        exc: BaseException | None = None
        try:
            for u in waits:
                stream.wait_event(self._events[u][1])
            start.record(stream)
            work(vid, s)
        except BaseException as e:  # reported to the executor, which stops the run
            exc = e
        finally:
            end.record(stream)
        return exc, local.lane_used

    def _helper(self, s: int, work: Work) -> None:
        """Runs the blocking vertices of stream `s`, which the loop holds meanwhile, and hands each
        back to the loop once its end event is recorded."""
        torch.cuda.set_device(self.device)
        get = self._helpers[s].get
        while (item := get()) is not None:
            vid, waits, evs = item
            with torch.cuda.stream(self.streams[s]):
                exc, lane_used = self._enqueue(vid, s, waits, evs, work)
            self._recorded.append((vid, s, evs, lane_used, exc))
            self._wake.set()

    def _waker(self, s: int) -> None:
        """Wakes the sleeping loop when stream `s` finishes the vertex the loop armed it with."""
        torch.cuda.set_device(self.device)
        get, wake = self._arms[s].get, self._wake
        while True:
            end = get()
            if end is None:
                return
            with contextlib.suppress(BaseException):  # the loop's query reports the error
                end.synchronize()  # blocks this thread only (the GIL is released)
            wake.set()

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), blocking: bool = False) -> None:
        # the executor submits under its lock, lowest id first: this deque holds its order
        self._submitted.append((vid, stream, waits, blocking))
        self._wake.set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host <-> device: on that direction's lane, the current stream waiting on it after the
        copy; device <-> device: on the current stream. Asynchronous (pinned host memory)."""
        lane = (
            self.h2d
            if dst.is_cuda and not src.is_cuda
            else self.d2h
            if src.is_cuda and not dst.is_cuda
            else None
        )
        if lane is None:
            dst.copy_(src, non_blocking=True)
            return
        cur = torch.cuda.current_stream()
        local = self._local
        lane.wait_stream(cur)  # after whatever this vertex enqueued before
        with torch.cuda.stream(lane):
            if getattr(local, "lane_used", True) is False:  # the vertex's first lane copy
                local.lane_start.record(lane)
                local.lane_used = True
            dst.copy_(src, non_blocking=True)
        cur.wait_stream(lane)  # the vertex's end event follows its copy

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
        IMPLS[op](out, ins, attrs)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        for q in self._arms + self._helpers:
            q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._arms, self._helpers, self._threads = [], [], []
        if self.streams:
            torch.cuda.synchronize(self.device)
        self.streams = []
        self.h2d = self.d2h = None

    def statistics(self) -> dict:
        return {
            "backend": self.name,
            "device": str(self.device),
            "streams": len(self.streams),
            **self.allocated,
            "host": host_statistics(*self._host),
        }


def host_statistics(launches: int, launch_ns: int, idle_ns: int, blocking: int) -> dict:
    """The loop's counters: vertices launched, host time in the `work` of those it ran itself,
    time asleep with vertices in flight (the host waiting on the device), vertices a helper ran."""
    own = launches - blocking
    return {
        "launches": launches,
        "launch_s": launch_ns / 1e9,
        "launch_us_mean": launch_ns / own / 1e3 if own else 0.0,
        "idle_s": idle_ns / 1e9,
        "blocking": blocking,
    }


def _warm(stream: torch.cuda.Stream, device: torch.device, workspace: int) -> None:
    """Creates cuBLAS's handle and workspace for `stream`, and leaves `workspace` bytes (one
    large-pool block) and one small-pool segment cached for that stream in torch's allocator."""
    with torch.cuda.stream(stream):
        for dt in _WARM_DTYPES:
            a = torch.ones(64, 64, dtype=dt, device=device)
            torch.matmul(a, a)
        keep = [torch.empty(256 << 10, dtype=torch.uint8, device=device)]  # small pool: a 2 MiB segment
        if workspace > (1 << 20):
            keep.append(torch.empty(workspace, dtype=torch.uint8, device=device))
        del keep  # freed into this stream's pools, not to the device


class _LoopState:
    """What the loop holds between passes."""

    def __init__(self, streams: int, clock: _Clock):
        self.waiting: collections.deque = collections.deque()  # submitted, not launched, in order
        self.held: dict[int, int] = {}  # stream -> the blocking vertex a helper runs on it
        self.inflight: list[collections.deque] = [collections.deque() for _ in range(streams)]  # launched
        self.armed: list = [None] * streams  # per stream: the end event its waker was given
        self.clock = clock


class _Clock:
    """Wall-clock times of device events: the host time of one synchronized base event plus the
    device's elapsed time since it (cudaEventElapsedTime, any two events of one device)."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.base = torch.cuda.Event(enable_timing=True)
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

    def interval(self, start: torch.cuda.Event, end: torch.cuda.Event) -> tuple[int, int]:
        """(t0_ns, t1_ns) of two completed events."""
        base = self.base
        return (
            self.base_ns + int(base.elapsed_time(start) * 1e6),
            self.base_ns + int(base.elapsed_time(end) * 1e6),
        )
