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

`install()` is the stand-in's own `install` with those parts replaced, from the checkout
PYTHONPATH names, so it also runs an older checkout's runtime (before/after comparisons, back to
commit f7cc751).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from tests.fake_cuda import install as stand_in


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


def install(set_attr: Callable[[object, str, object], None] = setattr, *, gpus: int = 1) -> SimpleNamespace:
    """The stand-in of tests/fake_cuda.py (`install`: torch replaced in the actors modules that use
    CUDA, allocations, host registration, the current stream), with streams and events that do
    nothing and the backend's own launch loop, which runs work at launch (`set_attr`: pytest's
    `monkeypatch.setattr` in a test, undone after it). Returns what that `install` returns."""
    from actors.backends import cuda as cuda_backend
    from actors.backends import cuda_loop

    got = stand_in(set_attr, gpus=gpus)
    cuda = got.torch.cuda
    set_attr(cuda, "Stream", NullStream)
    set_attr(cuda, "Event", NullEvent)
    set_attr(cuda, "synchronize", lambda device=None: None)
    set_attr(cuda_backend, "CudaLoop", cuda_loop.CudaLoop)
    return got
