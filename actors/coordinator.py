"""Coordinator: the Ray actor shell around `actors.scheduler.Scheduler`.

Workers call `report` with batches of completed vertices; the coordinator feeds them to the core
under a lock and queues the resulting `Dispatch` batches per worker. A sender thread sends each
worker's queued vertices as one fire-and-forget actor call; while it is busy sending (an actor
call costs ~0.3-1 ms of this process's time), new dispatches for a worker pile up and go out
together, so the message count adapts to the load. `wait` blocks (one actor thread) until the
run finished or failed.

Like the workers, it holds several graphs (one `Scheduler` each, under the engine's key); `start`
makes one the active graph, whose counters the reports of that run feed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MemGraph

from .scheduler import Abort, Completed, Dispatch, Finished, Instruction, Scheduler, WorkerFailed


class Coordinator:
    def __init__(self) -> None:
        self.sched: Scheduler | None = None  # the active graph's
        self.scheds: dict[str, Scheduler] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: str | None = None
        self.workers: Sequence[Any] = ()
        self._outbox: dict[int, list[int]] = {}  # gpu -> vertices to dispatch, guarded by _send_cv
        self._send_cv = threading.Condition()
        self._reset_stats()
        threading.Thread(target=self._send_loop, daemon=True, name="dispatch-sender").start()

    def _reset_stats(self) -> None:
        self._handle_s = self._send_s = 0.0
        self._reports = self._sends = 0

    def _core(self) -> Scheduler:
        if self.sched is None:
            raise RunError("the coordinator has no graph loaded")
        return self.sched

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        """This actor's process id (the driver names a stalled actor by it)."""
        return os.getpid()

    def load(self, key: str, mg: MemGraph, workers: Sequence[Any]) -> None:
        """Adds graph `key` (replacing one of that key); `workers[g]` is the actor of GPU g."""
        self.scheds[key] = Scheduler(mg)
        self.workers = workers

    def unload(self, key: str) -> None:
        sched = self.scheds.pop(key, None)
        if sched is not None and sched is self.sched:
            self.sched = None

    def start(self, key: str) -> None:
        """Makes graph `key` active, resets its counters and hands every worker its vertices without
        remote predecessors."""
        if key not in self.scheds:
            raise RunError(f"the coordinator has no graph {key!r} loaded")
        self.sched = self.scheds[key]
        self._reset_stats()
        self._done.clear()
        self._error = None
        with self._send_cv:
            self._outbox.clear()
        with self._lock:
            instrs = self._core().start()
        self._apply(instrs)

    @ray.method(num_returns=0)  # fire and forget: no return object to make
    def report(self, gpu: int, vids: list[int]) -> None:
        t = time.perf_counter()
        with self._lock:
            instrs = self._core().handle(Completed(gpu, vids))
            self._handle_s += time.perf_counter() - t
            self._reports += 1
        self._apply(instrs)

    @ray.method(num_returns=0)
    def fail(self, gpu: int, vid: int | None, message: str) -> None:
        with self._lock:
            instrs = self._core().handle(WorkerFailed(gpu, vid, message))
        self._apply(instrs)

    def _apply(self, instrs: list[Instruction]) -> None:
        for i in instrs:
            if isinstance(i, Dispatch):
                with self._send_cv:
                    self._outbox.setdefault(i.gpu, []).extend(i.vids)
                    self._send_cv.notify()
            elif isinstance(i, Finished):
                self._done.set()
            elif isinstance(i, Abort):
                self._error = i.message
                self._done.set()

    def _send_loop(self) -> None:
        while True:
            with self._send_cv:
                while not self._outbox:
                    self._send_cv.wait()
                out, self._outbox = self._outbox, {}
            t = time.perf_counter()
            for g, vids in out.items():
                try:
                    self.workers[g].dispatch.remote(vids)
                except Exception as e:  # keep the thread alive; the driver gets the message
                    self._error = f"the coordinator could not dispatch to gpu:{g}: {e}"
                    self._done.set()
            self._send_s += time.perf_counter() - t
            self._sends += len(out)

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
        """The core's counters, plus reports handled, dispatch calls sent and the time spent on each."""
        return {
            **self._core().statistics(),
            "reports": self._reports,
            "dispatch_calls": self._sends,
            "handle_s": round(self._handle_s, 6),
            "send_s": round(self._send_s, 6),
        }
