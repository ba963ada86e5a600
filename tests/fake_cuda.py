"""A stand-in for torch.cuda, on the host, that behaves like a device: runs the cuda backend's
threads (loop, wakers, helpers, the NCCL channel), events, stream order and launch order on
machines without a GPU, with device memory as CPU tensors and kernels on the CPU.

`install(setattr)` puts it under the actors modules that use torch.cuda (pass pytest's
`monkeypatch.setattr` in a test; the builtin `setattr` in a script).

Asynchrony (tests/fake_device.py, tests/fake_launch.py). The work a vertex launches on a stream
(the whole `work` call the launch loop makes with that stream current: its kernels and copies)
is enqueued, not run: it runs later, on that stream's own thread, in launch order per stream, when the host
needs it (a query or synchronize of an event after it, or a stream waiting on such an event):
as late as CUDA allows. So:
- a stream that waits on an event runs nothing after the wait before the event's point has run;
  a stream that forgot to wait runs without the other stream's work (a kernel reads a range a
  copy on a lane has not written yet);
- the range a vertex's work overwrites (the executor's plan: a kernel's output, a copy's
  destination, device or pinned host memory) is filled with 0xFF bytes (NaN in every float
  dtype) from launch, or from when what it waits on and its stream's earlier work have run (they
  may read the range's old bytes), until the work has run: a host read without a
  synchronisation, or a consumer that did not wait, reads poison rather than last run's bytes;
- an event whose record a point of work (the event recorded after the waits) already waited on
  before its own previous record is stale, an event of an earlier run: recording that point
  raises `StaleEventError`;
- an error of the work is asynchronous: the next event recorded on its stream raises it.
Work a helper runs (BLOCKING: a wait on the host, then a copy) runs on the helper once its
stream has run everything before it (the copy after the host wait, as a GPU orders it); the
registration of a DEFERRED vertex (an NCCL receive) runs at once: its device work is the NCCL
operation the channel enqueues later (tests/fake_nccl.py).

Device time: each event recorded on a stream also moves that stream's simulated device clock
on by `FakeStream.device_s`, and the event completes only once the host clock has passed it,
so the loop also sees vertices still running on the device and sleeps until a waker wakes it.

Device order. An event or a blocking device operation (an NCCL send or receive) completes only
once everything before it on its stream has, and a stream that waits on an event continues only
once that event has. So an event recorded after an NCCL receive completes only when the
receive has matched its send, as on a GPU.

What the real API would make a bug, the stand-in makes visible:
- `Event.synchronize` on an event without the blocking-sync flag busy-waits a CPU core on a GPU;
  here it counts the spin in `FakeEvent.spins` (a test asserts none);
- `Event.elapsed_time` of an event made without timing raises, as CUDA does;
- a device allocation (`torch.empty(..., device=...)`) is counted in `DEVICE_LIVE` until its
  memory is released (the last view of it gone), so a test sees what stays on the "GPU";
- `cudart().cudaHostRegister` records each registration (`FakeCudart.registered`), and
  `torch.empty(..., pin_memory=True)` records the power-of-two block torch's caching host
  allocator would pin (`PINNED_BLOCKS`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from tests import fake_device, fake_launch
from tests.fake_device import StreamThread, _cv, _Item, _Join, _local, _lock, _Mark, _Work
from tests.fake_launch import POISON, deferred, written

__all__ = [
    "POISON",
    "FakeEvent",
    "FakeStream",
    "StaleEventError",
    "_Item",
    "_cv",
    "_lock",
    "deferred",
    "install",
    "written",
]


class StaleEventError(RuntimeError):
    """A stream waited on an event whose record is from an earlier run."""


class FakeEvent:
    """Host-side stand-in for torch.cuda.Event: `record` enqueues a point in the stream's order
    (`_Mark`); `query`/`synchronize` run the stream up to it (and what it waits on) and report
    the asynchronous error of the work before it. Each record on a stream also moves that
    stream's simulated device clock on by `FakeStream.device_s`. As in CUDA, an event is its
    latest record: what waited on an earlier record is not moved by a later one."""

    spins = 0  # synchronize() calls on events without the blocking-sync flag (busy waits on a GPU)
    made: list = []  # (enable_timing, blocking) of every event made

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t = None
        self.mark: _Mark | None = None
        self.timing, self.blocking = enable_timing, blocking
        self.after: set = set()  # the records its previous record came after (stale-event check)
        FakeEvent.made.append((enable_timing, blocking))

    def record(self, stream=None):
        now = time.perf_counter()
        stream = stream if stream is not None else _current()
        with _lock:
            waited, stream.pending = stream.pending, []
            stale = [m for m in waited if m in self.after]
            if stale:
                raise StaleEventError(
                    f"stream {stream.cuda_stream:#x}: the point recorded here waited on an event "
                    "record it had already waited on before its previous record: a wait on an event "
                    "of an earlier run (its launcher had not recorded it in this run yet)"
                )
            self.after = set(waited)
            stream.t = self.t = max(stream.t, now) + FakeStream.device_s
            self.mark = stream.tail = _Mark(stream.tail, self.t)

    def query(self):
        if self.mark is None or not self.mark.complete():
            return False
        if self.mark.error is not None:
            raise self.mark.error
        return True

    def synchronize(self):
        assert self.mark is not None, "waited on an event never recorded"
        if not self.blocking:
            FakeEvent.spins += 1
        while not self.mark.complete():
            time.sleep(max(1e-4, min(1e-3, self.mark.t - time.perf_counter())))
        if self.mark.error is not None:
            raise self.mark.error

    def elapsed_time(self, end):
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with enable_timing=True")
        if self.t is None or end.t is None:
            raise RuntimeError("event not recorded")
        return (end.t - self.t) * 1e3


_ids = itertools.count()


class FakeStream:
    waited: list = []
    device_s = 0.0  # simulated device time per recorded event
    by_handle: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # cuda_stream -> stream
    every: weakref.WeakSet = weakref.WeakSet()  # what torch.cuda.synchronize() waits for

    def __init__(self, device=None, priority=0):
        self.t = 0.0
        self.tail: _Item | None = None
        self.pending: list[_Mark] = []  # records waited on since the last record on this stream
        self.cuda_stream = id(self)
        self.runner = StreamThread(self, f"fake-stream-{next(_ids)}")
        FakeStream.by_handle[self.cuda_stream] = self
        FakeStream.every.add(self)

    @property
    def thread(self) -> threading.Thread | None:
        return self.runner.thread

    def hand(self, work: _Work) -> None:
        self.runner.hand(work)

    def enqueue(self, item_of: Callable[[_Item | None], _Item]) -> _Item:
        """Appends a device operation made by `item_of(previous tail)` to this stream's order."""
        with _lock:
            item = item_of(self.tail)
            self.tail = item
            return item

    def launch(self, fn: Callable[[], object]) -> _Work:
        """Enqueues `fn` as work: it runs later, on this stream's thread, in launch order."""
        return self.enqueue(lambda prev: _Work(prev, self, fn))  # type: ignore[return-value]

    def wait_event(self, ev):
        assert ev.mark is not None, "a stream waited on an event its launcher had not recorded"
        FakeStream.waited.append(ev)
        with _lock:
            self.t = max(self.t, ev.t)
            self.tail = _Join(self.tail, ev.mark)
            self.pending.append(ev.mark)

    def wait_stream(self, other):
        with _lock:
            self.t = max(self.t, other.t)
            self.tail = _Join(self.tail, other.tail)

    def synchronize(self):
        if threading.current_thread() is self.thread:  # from its own work: all before it has run
            return
        tail = self.tail
        while tail is not None and not tail.complete():
            time.sleep(1e-4)


_default = FakeStream()


def _current(device=None) -> FakeStream:
    return getattr(_local, "stream", None) or _default


def _synchronize(device=None) -> None:
    for s in list(FakeStream.every):
        s.synchronize()


@contextlib.contextmanager
def _stream_ctx(s):
    old = getattr(_local, "stream", None)
    _local.stream = s
    try:
        yield
    finally:
        _local.stream = old


class FakeCudart:
    """torch.cuda.cudart(): host registration, recorded."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # ptr -> bytes
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        assert ptr not in self.registered, "a host range registered twice"
        self.registered[ptr] = size
        self.calls.append(("register", ptr, size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        size = self.registered.pop(ptr, None)
        assert size is not None, "unregistered a host range that was not registered"
        self.calls.append(("unregister", ptr, size))
        return 0


PINNED_BLOCKS: list[int] = []  # what torch's caching host allocator would pin for pin_memory=True
DEVICE_LIVE: dict[int, int] = {}  # device allocations whose memory is still held: id -> bytes
_device_ids = itertools.count()


def _device_empty(shape, dtype) -> torch.Tensor:
    """A device allocation: host bytes whose release (the last view of them gone) is seen."""
    nb = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype or torch.float32).element_size()
    raw = np.zeros(
        nb, dtype=np.uint8
    )  # a tensor's storage keeps its numpy array alive: a finalizer sees the end
    k = next(_device_ids)
    DEVICE_LIVE[k] = nb
    weakref.finalize(raw, DEVICE_LIVE.pop, k, None)
    return torch.from_numpy(raw).view(dtype or torch.float32).view(shape)


def _empty(*size, dtype=None, device=None, pin_memory=False, **kw):
    n = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
    if device is not None and not pin_memory:
        return _device_empty(tuple(n), dtype)
    if pin_memory:  # torch's caching host allocator: a power-of-two block per request
        nb = (
            int(torch.Size(n if isinstance(n, tuple) else (n,)).numel())
            * torch.empty((), dtype=dtype).element_size()
        )
        PINNED_BLOCKS.append(1 << max(nb - 1, 0).bit_length())
    return torch.zeros(*size, dtype=dtype)


def fake_torch(cudart: FakeCudart | None = None, gpus: int = 1):
    cudart = cudart or FakeCudart()
    cuda = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        current_device=lambda: 0,
        device_count=lambda: gpus,
        set_device=lambda d: None,
        set_stream=lambda s: setattr(_local, "stream", s),
        synchronize=_synchronize,
        device=lambda d: contextlib.nullcontext(),
        stream=_stream_ctx,
        current_stream=_current,
        Stream=FakeStream,
        Event=FakeEvent,
        cudart=lambda: cudart,
        can_device_access_peer=lambda a, b: True,
        get_device_properties=lambda d: SimpleNamespace(uuid=f"FAKE-GPU-{getattr(d, 'index', d)}"),
    )
    return SimpleNamespace(
        cuda=cuda,
        device=lambda *a: torch.device("cpu"),
        empty=_empty,
        zeros=torch.zeros,
        ones=torch.ones,
        matmul=torch.matmul,
        uint8=torch.uint8,
        float16=torch.float16,
        bfloat16=torch.bfloat16,
        float32=torch.float32,
        Tensor=torch.Tensor,
        equal=torch.equal,
    )


MODULES = (
    "backends.cuda",
    "backends.cuda_loop",
    "backends.cuda_memory",
    "transports.nccl",
    "transports.cuda",
)


def install(set_attr: Callable[[object, str, object], None] = setattr, *, gpus: int = 1) -> SimpleNamespace:
    """Replaces torch in the actors modules that use CUDA by the stand-in, and the backend's launch
    loop by one whose vertices' work is enqueued on their stream (`deferring_loop`); the
    per-stream reservation of kernel temporaries is recorded instead of allocated. Returns what
    a test inspects: `cudart`, `reserved` ([(stream, nbytes)])."""
    import importlib

    from actors.backends import cuda as cuda_backend
    from actors.backends import cuda_loop

    cudart = FakeCudart()
    fake = fake_torch(cudart, gpus)
    reserved: list = []
    for name in MODULES:
        set_attr(importlib.import_module(f"actors.{name}"), "torch", fake)
    from actors.backends import cuda_memory

    set_attr(cuda_memory, "reserve", lambda stream, device, nbytes: reserved.append((stream, nbytes)))
    set_attr(cuda_backend, "CudaLoop", fake_launch.deferring_loop(cuda_loop.CudaLoop))
    set_attr(cuda_backend, "_FREE_STREAMS", {})  # streams of this device, not an earlier test's
    FakeEvent.spins = 0
    FakeEvent.made = []
    # a device of its own: an earlier test's stuck streams and their poisons are left alone
    FakeStream.every = weakref.WeakSet()
    fake_device._soon.clear()
    PINNED_BLOCKS.clear()
    return SimpleNamespace(cudart=cudart, reserved=reserved, torch=fake)
