"""A stand-in for torch.cuda, on the host: runs the cuda backend's threads (loop, wakers,
helpers, the NCCL channel), events, stream order and launch order on machines without a GPU,
with kernels on the CPU.

`install(setattr)` puts it under the actors modules that use torch.cuda (pass pytest's
`monkeypatch.setattr` in a test; the builtin `setattr` in a script). Work runs at launch; each
event recorded on a stream moves that stream's simulated device clock on by
`FakeStream.device_s`, so the loop also sees vertices still running on the device and sleeps
until a waker wakes it.

Device order. Each stream keeps a chain of what was enqueued on it (`FakeStream.tail`): an event
or a blocking device operation (an NCCL send or receive of tests/fake_nccl.py) completes only
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

_lock = threading.RLock()  # completion checks and NCCL matching run from several threads
_evaluating: set = set()  # items whose completion is being decided (under _lock)


class _Item:
    """One thing in a stream's device order; complete once `prev` and its own condition are."""

    __slots__ = ("done", "prev")

    def __init__(self, prev: _Item | None):
        self.prev = prev
        self.done = False

    def ready(self) -> bool:  # its own condition, once everything before it is done
        return True

    def complete(self) -> bool:
        if self.done:
            return True
        with _lock:
            if self in _evaluating:  # it waits on itself through other streams: a deadlock
                return False
            _evaluating.add(self)
            try:
                chain = []
                x: _Item | None = self
                while x is not None and not x.done:
                    chain.append(x)
                    x = x.prev
                for y in reversed(chain):  # oldest first: each sees its predecessor done
                    if not y.ready():
                        return False
                    y.done = True
                    y.prev = None  # drop the chain behind it
                return True
            finally:
                _evaluating.discard(self)


class _Join(_Item):
    """A stream's wait on an event of any stream."""

    __slots__ = ("other",)

    def __init__(self, prev: _Item | None, other: _Item | None):
        super().__init__(prev)
        self.other = other

    def ready(self) -> bool:
        return self.other is None or self.other.complete()


class _Mark(_Item):
    """Where an event was recorded: complete once the stream got there and its time has come."""

    __slots__ = ("t",)

    def __init__(self, prev: _Item | None, t: float):
        super().__init__(prev)
        self.t = t

    def ready(self) -> bool:
        return time.perf_counter() >= self.t


class FakeEvent:
    """Host-side stand-in for torch.cuda.Event. Work runs on the CPU at launch; each record on a
    stream also moves that stream's simulated device clock on by `FakeStream.device_s`, and the
    event completes (query, synchronize) once the host clock passes the stream's and the work
    before it on the stream has completed. As in CUDA, an event is its latest record: what waited
    on an earlier record is not moved by a later one."""

    spins = 0  # synchronize() calls on events without the blocking-sync flag (busy waits on a GPU)
    made: list = []  # (enable_timing, blocking) of every event made

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t = None
        self.mark: _Mark | None = None
        self.timing, self.blocking = enable_timing, blocking
        FakeEvent.made.append((enable_timing, blocking))

    def record(self, stream=None):
        now = time.perf_counter()
        stream = stream if stream is not None else _current()
        with _lock:
            stream.t = self.t = max(stream.t, now) + FakeStream.device_s
            self.mark = stream.tail = _Mark(stream.tail, self.t)

    def query(self):
        return self.mark is not None and self.mark.complete()

    def synchronize(self):
        assert self.mark is not None, "waited on an event never recorded"
        if not self.blocking:
            FakeEvent.spins += 1
        while not self.mark.complete():
            time.sleep(max(1e-4, min(1e-3, self.mark.t - time.perf_counter())))

    def elapsed_time(self, end):
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with enable_timing=True")
        if self.t is None or end.t is None:
            raise RuntimeError("event not recorded")
        return (end.t - self.t) * 1e3


class FakeStream:
    waited: list = []
    device_s = 0.0  # simulated device time per recorded event
    by_handle: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # cuda_stream -> stream

    def __init__(self, device=None, priority=0):
        self.t = 0.0
        self.tail: _Item | None = None
        self.cuda_stream = id(self)
        FakeStream.by_handle[self.cuda_stream] = self

    def enqueue(self, item_of: Callable[[_Item | None], _Item]) -> _Item:
        """Appends a device operation made by `item_of(previous tail)` to this stream's order."""
        with _lock:
            item = item_of(self.tail)
            self.tail = item
            return item

    def wait_event(self, ev):
        assert ev.mark is not None, "a stream waited on an event its launcher had not recorded"
        FakeStream.waited.append(ev)
        with _lock:
            self.t = max(self.t, ev.t)
            self.tail = _Join(self.tail, ev.mark)

    def wait_stream(self, other):
        with _lock:
            self.t = max(self.t, other.t)
            self.tail = _Join(self.tail, other.tail)

    def synchronize(self):
        tail = self.tail
        while tail is not None and not tail.complete():
            time.sleep(1e-4)


_local = threading.local()
_default = FakeStream()


def _current() -> FakeStream:
    return getattr(_local, "stream", None) or _default


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
        synchronize=lambda d=None: None,
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
    """Replaces torch in the actors modules that use CUDA by the stand-in; the per-stream
    reservation of kernel temporaries is recorded instead of allocated. Returns what a test
    inspects: `cudart`, `reserved` ([(stream, nbytes)])."""
    import importlib

    cudart = FakeCudart()
    fake = fake_torch(cudart, gpus)
    reserved: list = []
    for name in MODULES:
        set_attr(importlib.import_module(f"actors.{name}"), "torch", fake)
    from actors.backends import cuda_memory

    set_attr(cuda_memory, "reserve", lambda stream, device, nbytes: reserved.append((stream, nbytes)))
    FakeEvent.spins = 0
    FakeEvent.made = []
    PINNED_BLOCKS.clear()
    return SimpleNamespace(cudart=cudart, reserved=reserved, torch=fake)
