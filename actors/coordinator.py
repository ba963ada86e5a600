"""Coordinator: the Ray actor shell around `actors.scheduler.Scheduler`.

Workers call `report` with batches of completed vertices; the coordinator feeds them to the core
under a lock and sends the resulting per-worker `Dispatch` batches with fire-and-forget actor
calls. `wait` blocks (one actor thread) until the run finished or failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from disco_ray.errors import RunError
from disco_ray.memgraph import MemGraph

from .scheduler import Abort, Completed, Dispatch, Finished, Instruction, Scheduler, WorkerFailed


class Coordinator:
    def __init__(self) -> None:
        self.sched: Scheduler | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: str | None = None
        self.workers: Sequence[Any] = ()
        self._handle_s = self._apply_s = 0.0
        self._reports = 0

    def _core(self) -> Scheduler:
        if self.sched is None:
            raise RunError("the coordinator has no graph loaded")
        return self.sched

    def ping(self) -> bool:
        return True

    def load(self, mg: MemGraph, workers: Sequence[Any]) -> None:
        """Takes the next graph; `workers[g]` is the actor of GPU g."""
        self.sched = Scheduler(mg)
        self.workers = workers

    def start(self) -> None:
        """Resets the counters and hands every worker its vertices without remote predecessors."""
        self._handle_s = self._apply_s = 0.0
        self._reports = 0
        self._done.clear()
        self._error = None
        with self._lock:
            instrs = self._core().start()
        self._apply(instrs)

    @ray.method(num_returns=0)  # fire and forget: no return object to make
    def report(self, gpu: int, vids: list[int]) -> None:
        t = time.perf_counter()
        with self._lock:
            instrs = self._core().handle(Completed(gpu, vids))
            t1 = time.perf_counter()
        self._apply(instrs)
        self._handle_s += t1 - t
        self._apply_s += time.perf_counter() - t1
        self._reports += 1

    @ray.method(num_returns=0)
    def fail(self, gpu: int, vid: int | None, message: str) -> None:
        with self._lock:
            instrs = self._core().handle(WorkerFailed(gpu, vid, message))
        self._apply(instrs)

    def _apply(self, instrs: list[Instruction]) -> None:
        for i in instrs:
            if isinstance(i, Dispatch):
                self.workers[i.gpu].dispatch.remote(i.vids)
            elif isinstance(i, Finished):
                self._done.set()
            elif isinstance(i, Abort):
                self._error = i.message
                self._done.set()

    def wait(self, timeout: float | None = None) -> tuple[bool, str | None]:
        """(finished, error message or None); blocks up to `timeout` seconds."""
        ok = self._done.wait(timeout)
        return ok, self._error

    def progress(self) -> int:
        return self._core().completed

    def held_by(self, gpu: int) -> list[int]:
        with self._lock:
            return self._core().held_by(gpu)

    def statistics(self) -> dict:
        """The core's counters plus the time this shell spent in the core and sending dispatches."""
        return {
            **self._core().statistics(),
            "reports": self._reports,
            "handle_s": round(self._handle_s, 6),
            "send_s": round(self._apply_s, 6),
        }
