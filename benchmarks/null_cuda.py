"""A device infinitely faster than the host, for measuring the host alone
(`benchmarks/bench_host.py --device null`).

The strict stand-in of tests/fake_cuda.py makes a missing wait corrupt data: work runs later on
each stream's own thread, and every event, wait and query walks its stream's order under a lock
in Python. That is what its tests need, but as a benchmark of the host it mostly measures
itself: a hand-over to a stream thread per launch, Python events and locks where a GPU has C
calls of a few microseconds. Here every CUDA call is one Python call that does nothing: work runs
at launch on the launch loop (the host's own cost of a kernel: torch's dispatch, on tiny CPU
tensors), every event has completed by the time the host queries it, waits and records cost a
call each. That is the regime of a decode step on a GPU, whose kernels take 10-50 us: the host
sets the pace, and what is measured is the runtime's own cost per vertex (loop, counters,
chains, launch ahead) plus one Python call per CUDA call.

`install()` puts it under the actors modules that use torch.cuda, as tests/fake_cuda.py does,
but keeps the backend's own launch loop (work runs at launch); the rest of the namespace
(allocations, host registration) is the stand-in's, from the checkout PYTHONPATH names, so it
also runs an older checkout's runtime (before/after comparisons, back to commit f7cc751).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from types import SimpleNamespace


class NullEvent:
    """Recorded, waited on and queried for free; always complete; no time passes on the device."""

    __slots__ = ()

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 0.0


class NullStream:
    __slots__ = ("__weakref__", "cuda_stream")

    def __init__(self, device=None, priority=0):
        self.cuda_stream = id(self)

    def wait_event(self, ev):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def null_torch(gpus: int = 1) -> SimpleNamespace:
    """The stand-in's torch namespace (tests/fake_cuda.py `fake_torch`: allocations, host
    registration, devices, the current stream) with streams and events that do nothing."""
    from tests.fake_cuda import MODULES, fake_torch

    fake = fake_torch(gpus=gpus)
    fake.cuda.Stream, fake.cuda.Event = NullStream, NullEvent
    fake.cuda.synchronize = lambda device=None: None
    fake.modules = MODULES
    return fake


def install(set_attr: Callable[[object, str, object], None] = setattr, *, gpus: int = 1) -> SimpleNamespace:
    """Replaces torch in the actors modules that use CUDA by the null device (`set_attr`: pytest's
    `monkeypatch.setattr` in a test, undone after it)."""
    fake = null_torch(gpus)
    for name in fake.modules:
        with contextlib.suppress(ImportError):
            set_attr(importlib.import_module(f"actors.{name}"), "torch", fake)
    from actors.backends import cuda as cuda_backend
    from actors.backends import cuda_memory

    set_attr(cuda_memory, "reserve", lambda stream, device, nbytes: None)
    if hasattr(cuda_backend, "_FREE_STREAMS"):
        set_attr(cuda_backend, "_FREE_STREAMS", {})
    return fake
