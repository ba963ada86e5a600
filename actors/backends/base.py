"""The backend contract: where a worker's arena and host store live and how its streams run work.

The executor (`actors.executor`) is backend-neutral: it builds torch views of the arena and host
store once, and for each vertex hands a stream a call `work(vid, stream)` that issues torch ops
on those views (`copy`, `kernel`). `Backend` lists every member the runtime may use; a backend
subclasses `BackendBase`, which gives the optional ones their defaults, and implements the
others (torch.distributed's `Backend` and Ray's `experimental.channel` interfaces have the same
shape: one written contract, defaults for what most implementations do not need, a registry by
name in `actors.backends`).

Threads. "The loading thread" is the one that makes the executor (the worker actor's call that
loads a graph, or the local engine's caller); "a stream thread" is one of the backend's own
threads that run `work` (cpu: one per stream; cuda: the loop and its helpers); the executor calls
`submit` with its lock held, from the thread that dispatched vertices or the one that ran a
`done`. Nothing is allocated while a graph runs (TURNIP section 5): `alloc` and `open` are only
called at load time.

The built-in backends: `actors.backends.cpu` (CPU tensors, a thread per stream) and
`actors.backends.cuda` (the arena on the GPU, pinned host buffers, CUDA streams driven from one
host thread, `actors.backends.cuda_loop`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Any, Protocol

import torch

from disco_ray.graph.errors import RunError

Work = Callable[[int, int], None]  # (vid, stream): issues the vertex's copies or kernel, or a unit's kernels
Done = Callable[[int, int, int, int, "BaseException | None"], None]  # (vid, stream, t0_ns, t1_ns, exc)


class Mode(IntEnum):
    """How a vertex's `work` behaves (`Backend.submit(..., mode)`, `Transport.mode`)."""

    LAUNCH = 0  # it only enqueues (cuda) or runs (cpu): the launching thread runs it
    BLOCKING = 1  # it waits on the host (a transfer whose bytes come through a Ray call): run aside
    # it hands its device work to another thread (an NCCL receive, `actors.transports.nccl`), which
    # enqueues it later through the backend's `external_begin` / `external_end`
    DEFERRED = 2


class Backend(Protocol):
    """Every member of a backend the runtime uses (`BackendBase` gives the optional ones)."""

    name: str  # the registry name ("cpu", "cuda")
    device: torch.device  # the torch device of the arena
    # read at load: graph inputs are copied into one buffer from `alloc(..., host=True)` before
    # their loads (cuda: a pinned buffer, so the host-to-device copies run at full speed)
    stages_inputs: bool
    # read at each run's start: `work` has only enqueued when it returns (the device runs it
    # later), so the sanitizer's checks at launch need launch ahead off
    async_launch: bool
    default_ahead: int  # kernels launched ahead per stream when `WorkerConfig.ahead` is None

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        """One uint8 buffer of exactly `nbytes`, allocated once, on the loading thread.

        Args:
            nbytes: its size.
            host: True for host memory (the host store, staged inputs, states, resident inputs,
                bounce buffers; a CUDA backend pins it), False for the arena on `device`.

        Raises:
            RunError: naming what could not be allocated and how much.
        """
        ...

    def open(
        self, streams: int, work: Work, done: Done, workspace: int = 0, kernel_streams: int | None = None
    ) -> None:
        """Makes `streams` streams and remembers the executor's callbacks; once per executor, on
        the loading thread, before any `submit`.

        Args:
            streams: the executor's compute streams, then its copy lanes
                (`actors.slots.StreamSlots`).
            work: what a stream runs for a vertex (`submit`).
            done: what the backend calls when a vertex's work has finished (`submit`).
            workspace: bytes of kernel temporaries to keep ready on each kernel stream.
            kernel_streams: how many of the first streams run kernels (None: all).
        """
        ...

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), mode: Mode = Mode.LAUNCH) -> None:
        """Runs `work(vid, stream)` on `stream` once every vertex of `waits` (submitted earlier, to
        any stream) has finished and after the vertices submitted to that stream before it.

        Called with the executor's lock held (from a dispatching thread or a stream thread inside
        `done`), so it must return without running `work` or `done` itself. When the work has
        finished (cuda: when the stream has executed what `work` enqueued) the backend calls
        `done(vid, stream, t0_ns, t1_ns, exc)` from any of its threads, with wall-clock start and
        end times (time.time_ns base) and the exception `work` raised (or None). A vertex of
        `waits` counts as finished once its `done` has returned (cpu) or once the device has
        executed it (cuda: the stream waits on its event, `async_launch`).

        Args:
            stream: the stream index, below `open`'s `streams`.
            vid: the MemGraph vertex.
            waits: vertices on other streams it must run after.
            mode: how `work` behaves (`Mode`).
        """
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A byte copy between two views, asynchronous on the current stream; called inside `work`
        on a stream thread (loads, offloads, local transfers)."""
        ...

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
        """The `disco_ray.graph.kernels` implementation of `op` writing `out` (attrs complete);
        called inside `work` on a stream thread."""
        ...

    def close(self) -> None:
        """Stops the streams and their threads; on the unloading thread, once per `open`. The
        buffers `alloc` made are freed when their last view goes."""
        ...

    def statistics(self) -> dict:
        """Counters for the run summary (`{}`: none); from the shell's thread, between runs."""
        ...

    def stream(self, s: int) -> Any:
        """The native stream object of stream `s` (cuda: a `torch.cuda.Stream`), for a transport
        that issues its own work on a lane (NCCL); on the loading thread, after `open`."""
        ...

    def external_begin(self, vid: int) -> Any:
        """For a DEFERRED vertex `vid`, from the thread that enqueues its device work (the NCCL
        channel's): makes its stream wait on its `waits`, records its start, and returns that
        stream. Its work is enqueued next, then `external_end`."""
        ...

    def external_end(self, vid: int, exc: BaseException | None = None) -> None:
        """The DEFERRED vertex `vid`'s work is enqueued (or failed: `exc`), on the same thread as
        its `external_begin`; the backend calls `done` once the device has run it."""
        ...


class BackendBase:
    """The optional members of `Backend`, with the defaults of a backend whose `work` runs on the
    host and finishes when it returns (as the cpu backend's does)."""

    name = "?"
    stages_inputs = False
    async_launch = False
    default_ahead = 0  # a stream thread runs its work itself: launching ahead gains nothing

    def statistics(self) -> dict:
        return {}

    def stream(self, s: int) -> Any:
        raise RunError(f"backend {self.name!r} has no native streams for a transport to use")

    def external_begin(self, vid: int) -> Any:
        raise RunError(f"backend {self.name!r} runs no DEFERRED work (vertex {vid})")

    def external_end(self, vid: int, exc: BaseException | None = None) -> None:
        raise RunError(f"backend {self.name!r} runs no DEFERRED work (vertex {vid})")
