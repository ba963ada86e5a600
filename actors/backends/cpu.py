"""The cpu backend: the arena and host store are CPU tensors, each stream a worker thread.

The contract it implements is `actors.backends.base.Backend`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping

import numpy as np
import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.kernels import IMPLS

from .base import BackendBase, Done, Mode, Work

_STOP = -1


class CpuBackend(BackendBase):
    """Arena and host store are CPU uint8 tensors; each stream is a thread running its vertices in
    submission order, each after the vertices it waits on.

    Kernels run synchronously in the stream thread; torch releases the GIL inside its ops, so
    streams overlap for real on large tensors.
    """

    name = "cpu"
    device = torch.device("cpu")
    async_launch = False  # `work` has finished when it returns

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        # vid -> set once its `done` returned; made only for a vertex another one waits on
        self._finished: dict[int, threading.Event] = {}

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        try:
            return torch.zeros(nbytes, dtype=torch.uint8)
        except (RuntimeError, MemoryError):  # the allocator's own message is a page of C++
            what = "host store" if host else "arena"
            raise RunError(
                f"cannot allocate the {nbytes}-byte {what} in host memory (the cpu backend keeps "
                "arenas there): a smaller capacity, or a machine with more memory"
            ) from None

    def open(
        self, streams: int, work: Work, done: Done, workspace: int = 0, kernel_streams: int | None = None
    ) -> None:
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

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), mode: Mode = Mode.LAUNCH) -> None:
        # `mode` changes nothing here: each stream has its own thread, which may wait on the host
        # (a Ray call); DEFERRED work (NCCL) only exists on cuda. The executor submits under its
        # lock, and a vertex of `waits` has not had its `done` yet (it counts as running), so its
        # event is made here before it could be looked up
        for u in waits:
            if u not in self._finished:
                self._finished[u] = threading.Event()
        self._queues[stream].put((vid, waits))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous():
            # one memcpy in this stream's thread: torch's copy_ splits a large copy over its
            # thread pool, which on a busy machine waits for cores (6 ms for 1 MiB on 2 loaded
            # cores, against 0.04 ms; benchmarks/bench_tiers.py)
            np.copyto(dst.numpy(), src.numpy())
        else:
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
