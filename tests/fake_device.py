"""The device order of the stand-in CUDA (tests/fake_cuda.py): what each stream has enqueued,
when it runs, and on which thread.

Each stream keeps a chain of items (`FakeStream.tail`): work, event records, waits on other
streams' events, NCCL operations (tests/fake_nccl.py). Nothing runs when it is enqueued. An
item runs when the host needs it: a `query` or `synchronize` of an event or stream after it, or
a stream waiting on a point after it that the host needs in turn; then everything before it on
its stream runs first, in launch order. The device is thus as late as CUDA allows, the one
schedule under which a missing wait always shows: a kernel queried before the copy it forgot to
wait on runs first and reads what the copy has not written yet.

Work runs on its stream's own thread (`_Work`, started when needed, gone when idle), with that
stream current; the host thread that needs it waits meanwhile. An error of a work item is
asynchronous, as a CUDA error is: the next event recorded after it on its stream carries it,
and `query`/`synchronize` of that event raise it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable

_lock = threading.RLock()  # completion checks and NCCL matching run from several threads
_cv = threading.Condition(_lock)  # a work item ran
_evaluating: set = set()  # items whose completion is being decided (under _lock)
_local = threading.local()  # the current stream of each thread
IDLE_S = 1.0  # a stream's thread ends after this long with nothing to run
WORK_TIMEOUT_S = 120.0  # the longest a host call waits on one work item before it reports "not done"


class _Item:
    """One thing in a stream's device order; complete once `prev` and its own condition are.
    `carry`: the asynchronous error of a work item before it, not yet taken by an event."""

    __slots__ = ("carry", "done", "prev")

    def __init__(self, prev: _Item | None):
        self.prev = prev
        self.done = False
        self.carry: BaseException | None = None

    def ready(self) -> bool:  # its own condition, once everything before it is done
        return True

    def settle(self, inherited: BaseException | None) -> None:
        """Done: passes on the error of the work before it."""
        self.carry = inherited

    def complete(self) -> bool:
        if self.done:
            return True
        with _lock:
            if self in _evaluating:  # it waits on itself through other streams (or another thread decides it)
                return False
            _evaluating.add(self)
            try:
                chain = []
                x: _Item | None = self
                while x is not None and not x.done:
                    chain.append(x)
                    x = x.prev
                for y in reversed(chain):  # oldest first: each sees its predecessor done
                    if y.done:  # another thread finished it while this one waited on a work item
                        continue
                    if not y.ready():
                        return False
                    if y.done:  # the same, after a wait on a work item
                        continue
                    y.settle(y.prev.carry if y.prev is not None else None)
                    y.done = True
                    y.prev = None  # drop the chain behind it
            finally:
                _evaluating.discard(self)
            if not getattr(_local, "probing", False):
                _early()
            return True


class _Join(_Item):
    """A stream's wait on an event of any stream."""

    __slots__ = ("other",)

    def __init__(self, prev: _Item | None, other: _Item | None):
        super().__init__(prev)
        self.other = other

    def ready(self) -> bool:
        return self.other is None or self.other.complete()


class _Mark(_Item):
    """Where an event was recorded: complete once the stream got there and its time has come;
    `error`: the asynchronous error of the work before it on its stream."""

    __slots__ = ("error", "t")

    def __init__(self, prev: _Item | None, t: float):
        super().__init__(prev)
        self.t = t
        self.error: BaseException | None = None

    def ready(self) -> bool:
        return time.perf_counter() >= self.t

    def settle(self, inherited: BaseException | None) -> None:
        self.error, self.carry = inherited, None


class _Work(_Item):
    """Work launched on a stream: runs on that stream's thread when something after it is needed."""

    __slots__ = ("exc", "fn", "state", "stream")

    NEW, HANDED, RAN = 0, 1, 2

    def __init__(self, prev: _Item | None, stream, fn: Callable[[], object]):
        super().__init__(prev)
        self.stream, self.fn = stream, fn
        self.state = _Work.NEW
        self.exc: BaseException | None = None

    def ready(self) -> bool:  # called under _lock
        if self.state == _Work.RAN:
            return True
        if threading.current_thread() is self.stream.thread or getattr(_local, "probing", False):
            return False  # its own stream's work (not in order), or a look that runs nothing
        if self.state == _Work.NEW:
            self.state = _Work.HANDED
            self.stream.hand(self)
        _cv.wait_for(lambda: self.state == _Work.RAN, WORK_TIMEOUT_S)  # releases _lock meanwhile
        return self.state == _Work.RAN

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # asynchronous: the next event on the stream reports it
            self.exc = e
        self.fn = None  # type: ignore[assignment]  # what it captured goes
        with _cv:
            self.state = _Work.RAN
            _cv.notify_all()

    def settle(self, inherited: BaseException | None) -> None:
        self.carry = self.exc or inherited


_soon: list[_Work] = []  # work to run as soon as everything before it has (not when needed)


def _early() -> None:
    """Runs, on this thread, each work of `_soon` whose predecessors have all run."""
    with _lock:
        for w in list(_soon):
            if w.state == _Work.NEW and settled(w.prev):
                w.state = _Work.HANDED
                w.run()
            if w.state != _Work.NEW:
                _soon.remove(w)


def settled(item: _Item | None) -> bool:
    """Whether everything up to `item` has run already, running nothing to find out."""
    if item is None or item.done:
        return True
    _local.probing = True
    try:
        return item.complete()
    finally:
        _local.probing = False


class StreamThread:
    """The thread that runs one stream's work items, in the order they are handed over (their
    launch order: a chain is completed oldest first)."""

    def __init__(self, stream, name: str):
        # weakly: a stream and its thread make no reference cycle, so a test's streams are freed
        # by reference counting, not by a later test's garbage collection
        self.stream, self.name = weakref.ref(stream), name
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def hand(self, work: _Work) -> None:  # under _lock
        self.q.put(work)
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, daemon=True, name=self.name)
            self.thread.start()

    def _serve(self) -> None:
        _local.stream = self.stream()
        while True:
            try:
                work = self.q.get(timeout=IDLE_S)
            except queue.Empty:
                with _lock:
                    if self.q.empty():
                        self.thread = None
                        return
                continue
            work.run()
