"""A worker's completion reports to the coordinator: batched, with a bounded lag.

Each report is a Ray call, and its host time is taken from launching; the coordinator only needs
completions for two things: another GPU waiting for one of them (reported within `flush_s`,
1 ms), and counting (what the end of the run, the progress bar and a dead worker's list of held
vertices read). So a busy worker batches the others, and sends them once the batch is
`interval` old, where `interval` keeps report calls to about 1/BUDGET of the reporter's time
(BUDGET x the mean host time of a report call, between `flush_s` and `lazy_s`): a cheap call
keeps the coordinator's view current to about a millisecond, an expensive one costs at most
that share. An idle worker, or one whose run failed (`flush` before the failure is sent), sends
at once.

`Reporter.take` is the pure decision (tests drive it with a fake clock); `ReportThread` runs it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

BUDGET = 20  # report calls take at most ~1/BUDGET of the time between lazy reports


class Reporter:
    """The queue of completions not yet reported, and when to send them (no threads, no clock)."""

    def __init__(self, flush_s: float, lazy_s: float):
        self.flush_s, self.lazy_s = flush_s, lazy_s
        self.queue: collections.deque[int] = collections.deque()
        self.urgent = False  # a completion another GPU waits for is queued
        self.sent_at = float("-inf")  # clock of the last report
        self.call_s = 0.0  # mean host time of a report call (exponential average)
        self.reports = 0

    @property
    def interval(self) -> float:
        """How long a busy worker may hold back completions nobody waits for."""
        return min(self.lazy_s, max(self.flush_s, BUDGET * self.call_s))

    def completed(self, vid: int, urgent: bool) -> None:
        """Queues `vid`; `urgent`: another GPU waits for it. The flag is set after the append, so
        a reader that clears it before reading the queue never loses it (see `take`)."""
        self.queue.append(vid)
        if urgent:
            self.urgent = True

    def take(self, now: float, busy: bool) -> list[int] | None:
        """The batch to send now, or None. The urgent flag is cleared BEFORE the queue is read: a
        completion appended meanwhile is either in this batch or leaves the flag set for the
        next call (clearing it after reading lost such a flag, and the completion waited up to
        `lazy_s` instead of `flush_s`)."""
        urgent, self.urgent = self.urgent, False
        n = len(self.queue)
        if not n or not (urgent or not busy or now - self.sent_at >= self.interval):
            return None
        self.sent_at = now
        self.reports += 1
        return [self.queue.popleft() for _ in range(n)]

    def timed(self, seconds: float) -> None:
        """A report call took `seconds` of host time."""
        self.call_s = seconds if self.reports <= 1 else 0.8 * self.call_s + 0.2 * seconds


class ReportThread:
    """Runs a `Reporter` for one worker: woken by each completion, it sends what `take` says, every
    `flush_s` while the worker is busy."""

    def __init__(
        self,
        gpu: int,
        send: Callable[[list[int]], None] | None,
        failed: Callable[[BaseException], None],
        busy: Callable[[], bool],
        flush_s: float,
        lazy_s: float,
    ):
        self.core = Reporter(flush_s, lazy_s)
        self._send, self._failed, self._busy = send, failed, busy
        self._lock = threading.Lock()  # one sender at a time: this thread or a failing one (`flush`)
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"reporter-{gpu}")
        self._thread.start()

    def completed(self, vid: int, urgent: bool) -> None:
        self.core.completed(vid, urgent)
        if not self._wake.is_set():
            self._wake.set()

    def flush(self) -> None:
        """Sends every queued completion now (before a failure is reported)."""
        self._send_due(busy=False)

    def _send_due(self, busy: bool) -> None:
        with self._lock:
            batch = self.core.take(time.perf_counter(), busy)
            if batch is None or self._send is None:
                return
            t = time.perf_counter()
            try:
                self._send(batch)
            except Exception as e:
                self._failed(e)
            self.core.timed(time.perf_counter() - t)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                return
            while not self._closing:  # a worker closed mid-run (its run failed elsewhere) stops too
                busy = self._busy()
                self._send_due(busy)
                if not busy:
                    break
                time.sleep(self.core.flush_s)

    @property
    def reports(self) -> int:
        return self.core.reports

    def reset(self) -> None:
        """A new run: nothing queued."""
        self.core.queue.clear()
        self.core.urgent = False

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=5)
