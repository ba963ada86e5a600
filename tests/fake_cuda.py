"""A stand-in for torch.cuda, on the host: runs the cuda backend's threads (loop, wakers,
helpers), events and launch order on machines without a GPU, with kernels on the CPU.

`install(setattr)` puts it under `actors.backend_cuda` (pass pytest's `monkeypatch.setattr` in a
test; the builtin `setattr` in a script). Work runs at launch; each event recorded on a stream
moves that stream's simulated device clock on by `FakeStream.device_s`, so the loop also sees
vertices still running on the device and sleeps until a waker wakes it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch


class FakeEvent:
    """Host-side stand-in for torch.cuda.Event. Work runs on the CPU at launch; each record on a
    stream also moves that stream's simulated device clock on by `FakeStream.device_s`, and the
    event completes (query, synchronize) once the host clock passes the stream's."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        now = time.perf_counter()
        if stream is None:
            self.t = now
        else:
            stream.t = self.t = max(stream.t, now) + FakeStream.device_s

    def query(self):
        return self.t is not None and time.perf_counter() >= self.t

    def synchronize(self):
        assert self.t is not None, "waited on an event never recorded"
        time.sleep(max(0.0, self.t - time.perf_counter()))

    def elapsed_time(self, end):
        if self.t is None or end.t is None:
            raise RuntimeError("event not recorded")
        return (end.t - self.t) * 1e3


class FakeStream:
    waited: list = []
    device_s = 0.0  # simulated device time per recorded event

    def __init__(self, device=None):
        self.t = 0.0

    def wait_event(self, ev):
        assert ev.t is not None, "a stream waited on an event its launcher had not recorded"
        FakeStream.waited.append(ev)
        self.t = max(self.t, ev.t)

    def wait_stream(self, other):
        self.t = max(self.t, other.t)


def fake_torch():
    cuda = SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        set_device=lambda d: None,
        set_stream=lambda s: None,
        synchronize=lambda d=None: None,
        device=lambda d: contextlib.nullcontext(),
        stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda: FakeStream(),
        Stream=FakeStream,
        Event=FakeEvent,
    )
    return SimpleNamespace(
        cuda=cuda,
        device=lambda *a: torch.device("cpu"),
        empty=lambda n, dtype, device=None, pin_memory=False: torch.zeros(n, dtype=dtype),
        uint8=torch.uint8,
    )


def install(set_attr: Callable[[object, str, object], None] = setattr) -> None:
    """Replaces torch in `actors.backend_cuda` by the stand-in (and its stream warm-up by nothing)."""
    from actors import backend_cuda

    set_attr(backend_cuda, "torch", fake_torch())
    set_attr(backend_cuda, "_warm", lambda *a: None)
