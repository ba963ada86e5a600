"""The CUDA backend: one arena on the GPU, one pinned host store, S torch.cuda.Streams.

TURNIP appendix A: a vertex is launched as asynchronous CUDA work on a stream, and a callback
tells the event loop when the stream has executed it. Here each stream has two threads:
- the launcher (1) makes the stream wait on the end events of the vertices the executor says
  this one waits on (`Stream.wait_event`: the device orders them, the host does not wait),
  (2) records a start event, runs `work(vid, s)` under `torch.cuda.stream(...)` (kernels and
  cudaMemcpyAsync are only enqueued) and records the end event, (3) hands the vertex to
  the waiter and takes the next one at once: with the executor's launch ahead (see
  `actors.executor`) the host prepares the next kernels of a chain while the device runs the
  current one, instead of a host round trip per kernel with the device idle;
- the waiter waits on each end event in order (`Event.synchronize` releases the GIL and blocks
  this thread alone) and calls `done`.
Rejected: cupy's `launch_host_func` callbacks (43 us median on the H100, run on CUDA's one
callback thread for all streams, and may not call CUDA themselves) and a poller thread (a poll
interval of latency).

A waited-on vertex may sit on another stream whose launcher has not reached it yet; a launcher
first waits (host side) until that vertex's end event is recorded. Every wait, like every turn of
the copy lanes below, is on a vertex submitted earlier, so the earliest unlaunched vertex can
always go: no deadlock.

Copies between host and device go through two FIFO copy lanes (one stream per direction), not
the vertex's own stream: the vertex's stream waits on the lane after its copy, so completion is
still one event. Measured on the H100 (bench_gpu_chain): loads issued on several streams run
concurrently and share PCIe, so each finishes late and the matmul waiting for the first one
starts late (1.26x the lower bound for the weight-streaming chain); in launch order (the
runtime launches lowest id first, i.e. the planner's order) the first load gets all the
bandwidth, as in a hand-written prefetch loop.

Times: the interval of a vertex is measured on the GPU (two timing events around its work, the
start one recorded after the waits; for a lane copy the start event is recorded on the lane, so
time spent queued behind earlier copies is not counted as busy); its end is the wall-clock
instant the waiter returned, its start that minus the GPU interval. The events are made once per
vertex (the first time it runs) and kept for later runs. `statistics()["host"]` sums, since
`open`, the launchers' host time per vertex (launching, and waiting on another launcher): a mean
launch time above the device time of a vertex means the host, not the GPU, sets the pace.

Nothing is allocated while a graph runs: the arena and host store come once from `alloc`, graph
inputs are staged once per run into a pinned buffer before it starts (`stages_inputs`, see
`actors.executor`), and `open` creates cuBLAS's per-stream workspace (a warm-up matmul) and
leaves `workspace` bytes (DISCO_CUDA_WORKSPACE, default 16 MiB) plus one small-block segment
cached in torch's allocator for each stream: kernel temporaries (e.g. rmsnorm's float32 copy)
are carved from those, since the caching allocator keeps blocks per stream. A kernel whose
temporaries exceed that still works, at the cost of one cudaMalloc the first time.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping

import torch

from disco_ray.errors import RunError
from disco_ray.kernels import IMPLS

from .backend import Done, Work

_STOP = -1
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
        self._local = threading.local()  # per launcher: its ticket, the start event of a lane copy
        self._turns = Turns()  # lane order: copies enter the lanes in submission order
        self._queues: list[queue.SimpleQueue] = []  # per stream: (vid, ticket, waits) to launch
        self._landing: list[queue.SimpleQueue] = []  # per stream: launched vertices to wait for
        self._threads: list[threading.Thread] = []
        self._events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]] = {}
        self._recorded: dict[int, threading.Event] = {}  # vid -> set once its end event is recorded
        # per launcher since `open`: [vertices launched, ns launching them, ns waiting for a
        # waited-on vertex's launcher]: is the host keeping up with the device?
        self._host: list[list[int]] = []
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
        self._queues = [queue.SimpleQueue() for _ in range(streams)]
        self._landing = [queue.SimpleQueue() for _ in range(streams)]
        self._host = [[0, 0, 0] for _ in range(streams)]
        self._turns = Turns()
        warmed = threading.Barrier(streams + 1)
        self._threads = [
            threading.Thread(
                target=self._launch_loop, args=(s, work, warmed), daemon=True, name=f"cuda-launch-{s}"
            )
            for s in range(streams)
        ] + [
            threading.Thread(target=self._wait_loop, args=(s, done), daemon=True, name=f"cuda-wait-{s}")
            for s in range(streams)
        ]
        self._warm_error: BaseException | None = None
        for t in self._threads:
            t.start()
        warmed.wait(timeout=120)  # every stream thread has its cuBLAS handle and workspace
        torch.cuda.synchronize(self.device)
        if self._warm_error is not None:
            err = self._warm_error
            self.close()
            raise RunError(f"backend 'cuda' on {self.device}: warming up the streams failed: {err}")

    def _launch_loop(self, s: int, work: Work, warmed: threading.Barrier) -> None:
        torch.cuda.set_device(self.device)
        stream = self.streams[s]
        # in this thread: torch keeps a cuBLAS handle per thread and its workspace per (handle, stream)
        try:
            _warm(stream, self.device, self.workspace)
        except BaseException as e:  # e.g. out of memory: `open` raises it
            self._warm_error = e
        warmed.wait(timeout=120)
        get, land = self._queues[s].get, self._landing[s].put
        events, recorded, local = self._events, self._recorded, self._local
        acc, ns = self._host[s], time.perf_counter_ns
        with torch.cuda.stream(stream):
            while True:
                vid, ticket, waits = get()
                if vid == _STOP:
                    land((_STOP, None, None, False))
                    return
                evs = events.get(vid)
                if evs is None:
                    evs = events[vid] = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                start, end, local.lane_start = evs
                local.lane_used = False
                local.ticket = ticket
                exc: BaseException | None = None
                t0 = t1 = ns()
                try:
                    for u in waits:
                        recorded[u].wait()  # its launcher has recorded its end event
                        stream.wait_event(events[u][1])
                    t1 = ns()
                    start.record(stream)
                    work(vid, s)
                except BaseException as e:  # reported to the executor, which stops the run
                    exc = e
                finally:
                    self._turns.resolve(ticket)  # no-op after a lane copy resolved it
                    end.record(stream)
                    recorded[vid].set()
                t2 = ns()
                acc[0] += 1
                acc[1] += t2 - t1
                acc[2] += t1 - t0
                land((vid, exc, evs, local.lane_used))

    def _wait_loop(self, s: int, done: Done) -> None:
        torch.cuda.set_device(self.device)
        get, clock = self._landing[s].get, time.time_ns
        while True:
            vid, exc, evs, lane_used = get()
            if vid == _STOP:
                return
            start, end, lane_start = evs
            try:
                end.synchronize()  # blocks this thread only (the GIL is released)
                t1 = clock()
                gpu_ns = int((lane_start if lane_used else start).elapsed_time(end) * 1e6)
            except BaseException as e:  # an asynchronous CUDA error of this vertex's work
                t1, gpu_ns = clock(), 0
                exc = exc or e
            done(vid, s, t1 - gpu_ns, t1, exc)

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = ()) -> None:
        # tickets number vertices in submission order (the executor submits lowest id first)
        self._recorded[vid] = threading.Event()  # before any vertex that waits on it is submitted
        self._queues[stream].put((vid, self._turns.take(), waits))

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
        first = getattr(local, "lane_used", True) is False  # a stream thread's first lane copy of a vertex
        if first:
            # lanes are FIFO: enqueue in submission order, not in the order the threads woke up
            self._turns.wait(local.ticket)
        lane.wait_stream(cur)  # after whatever this vertex enqueued before
        with torch.cuda.stream(lane):
            if first:
                local.lane_start.record(lane)
                local.lane_used = True
            dst.copy_(src, non_blocking=True)
        cur.wait_stream(lane)  # the vertex's end event follows its copy
        if first:
            self._turns.resolve(local.ticket)

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
        IMPLS[op](out, ins, attrs)

    def close(self) -> None:
        for q in self._queues:
            q.put((_STOP, -1, ()))
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._queues, self._landing, self._threads = [], [], []
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
            "host": host_statistics(self._host),
        }


def host_statistics(per_launcher: list[list[int]]) -> dict:
    """Totals of the launchers' [launches, ns launching, ns waiting] counters."""
    n = sum(c[0] for c in per_launcher)
    launch_ns = sum(c[1] for c in per_launcher)
    return {
        "launches": n,
        "launch_s": launch_ns / 1e9,
        "launch_us_mean": launch_ns / n / 1e3 if n else 0.0,
        "wait_s": sum(c[2] for c in per_launcher) / 1e9,
    }


class Turns:
    """Tickets in submission order; `wait(t)` returns once every earlier ticket is resolved (its
    vertex enqueued its lane copy, or finished launching without one). Never waits on a later
    ticket, so it cannot deadlock."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0
        self._low = 0  # every ticket below is resolved
        self._resolved: set[int] = set()

    def take(self) -> int:
        with self._cv:
            self._next += 1
            return self._next - 1

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._low >= ticket, timeout)

    def resolve(self, ticket: int) -> None:
        with self._cv:
            if ticket < self._low:
                return
            self._resolved.add(ticket)
            while self._low in self._resolved:
                self._resolved.discard(self._low)
                self._low += 1
            self._cv.notify_all()


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
