"""Backends: where a worker's arena and host store live and how its streams run work.

The executor (`actors.executor`) is backend-neutral: it builds torch views of the arena and host
store once, and for each vertex hands a stream a call `work(vid, stream)` that issues torch ops
on those views (`copy`, `kernel`). A backend supplies:

- `alloc(nbytes, host)`: one uint8 buffer, allocated once per worker (the arena when
  host=False, the host store when host=True; a CUDA backend pins the host store).
- `open(streams, work, done)`: S streams. `submit(stream, vid, waits, blocking)` runs `work(vid, stream)` on
  that stream once every vertex of `waits` (submitted earlier, to any stream) has finished, and
  after the vertices submitted to that stream before it; when the work has finished (for CUDA:
  when the stream has executed what `work` enqueued) the backend calls
  `done(vid, stream, t0_ns, t1_ns, exc)` from any thread, with wall-clock start and end times in
  ns (time.time_ns base) and the exception `work` raised (or None). `blocking` says that `work`
  waits on the host (a transfer whose source is asked by a Ray call), so a backend that launches
  every stream from one thread runs it elsewhere. A vertex of `waits` counts as
  finished once its `done` has returned (cpu) or once the device has executed it (cuda: the
  stream waits on its event, `async_launch`).
- `copy(dst, src)`: an asynchronous-on-the-current-stream byte copy between two views.
- `kernel(op, out, ins, attrs)`: `disco_ray.kernels` implementation of `op` writing `out`
  (attrs already completed with defaults).
- `device`: the torch device of the arena; `close()`.

The CUDA backend (`actors.backend_cuda`) allocates the arena with torch.empty(..., device="cuda"),
the host store pinned, maps streams to torch.cuda.Stream objects and launches `work` on all of them from one thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from disco_ray.errors import UsageError
from disco_ray.kernels import IMPLS

Work = Callable[[int, int], None]
Done = Callable[[int, int, int, int, "BaseException | None"], None]


class Backend(Protocol):
    name: str
    device: torch.device

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor: ...

    def open(self, streams: int, work: Work, done: Done) -> None: ...

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), blocking: bool = False) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None: ...

    def close(self) -> None: ...


_STOP = -1


class CpuBackend:
    """Arena and host store are CPU uint8 tensors; each stream is a thread running its vertices in
    submission order, each after the vertices it waits on.

    Kernels run synchronously in the stream thread; torch releases the GIL inside its ops, so
    streams overlap for real on large tensors.
    """

    name = "cpu"
    device = torch.device("cpu")
    async_launch = False  # `work` has finished when it returns
    default_ahead = 0  # a stream thread runs its work itself: launching ahead gains nothing

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        # vid -> set once its `done` returned; made only for a vertex another one waits on
        self._finished: dict[int, threading.Event] = {}

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def open(self, streams: int, work: Work, done: Done) -> None:
        self.close()
        self._queues = [queue.SimpleQueue() for _ in range(streams)]
        self._threads = [
            threading.Thread(target=self._loop, args=(s, work, done), daemon=True, name=f"stream-{s}")
            for s in range(streams)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, s: int, work: Work, done: Done) -> None:
        get = self._queues[s].get
        clock = time.time_ns
        finished = self._finished
        while True:
            vid, waits = get()
            if vid == _STOP:
                return
            for u in waits:
                ev = finished.get(u)
                if ev is not None:  # None: u finished and dropped its event already
                    ev.wait()
            exc = None
            t0 = clock()
            try:
                work(vid, s)
            except BaseException as e:  # reported to the executor, which stops the run
                exc = e
            try:
                done(vid, s, t0, clock(), exc)
            finally:
                ev = finished.pop(vid, None)
                if ev is not None:
                    ev.set()

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), blocking: bool = False) -> None:
        # `blocking` (the work waits on the host, e.g. a Ray call) changes nothing here: each
        # stream has its own thread. The executor submits under its lock, and a vertex of `waits` has not had its `done`
        # yet (it counts as running), so its event is made here before it could be looked up
        for u in waits:
            if u not in self._finished:
                self._finished[u] = threading.Event()
        self._queues[stream].put((vid, waits))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
        IMPLS[op](out, ins, attrs)

    def close(self) -> None:
        for q in self._queues:
            q.put((_STOP, ()))
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._queues, self._threads = [], []


def make_backend(name: str) -> Backend:
    """The backend called `name` ("cpu"; "cuda" once that backend is added)."""
    if name == "cpu":
        return CpuBackend()
    if name == "cuda":
        try:
            from actors.backend_cuda import CudaBackend  # type: ignore[import-not-found]
        except ImportError:
            raise UsageError("backend 'cuda' is not available in this build (use --backend cpu)") from None
        return CudaBackend()
    raise UsageError(f"unknown backend {name!r} (cpu or cuda)")
