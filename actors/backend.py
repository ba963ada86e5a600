"""Backends: where a worker's arena and host store live and how its streams run work.

The executor (`actors.executor`) is backend-neutral: it builds torch views of the arena and host
store once, and for each vertex hands a stream a call `work(vid, stream)` that issues torch ops
on those views (`copy`, `kernel`). A backend supplies:

- `alloc(nbytes, host)`: one uint8 buffer of exactly `nbytes`, allocated once (the arena when
  host=False, the host store, staged inputs and states when host=True; a CUDA backend pins
  host buffers).
- `open(streams, work, done, workspace, kernel_streams)`: `streams` streams (the executor's
  compute streams, then its copy lanes, `actors.worker_core.StreamSlots`); the first
  `kernel_streams` run kernels, each with `workspace` bytes of kernel temporaries kept ready. `submit(stream, vid, waits, mode)` runs `work(vid, stream)` on that
  stream once every vertex of `waits` (submitted earlier, to any stream) has finished, and
  after the vertices submitted to that stream before it; when the work has finished (for CUDA:
  when the stream has executed what `work` enqueued) the backend calls
  `done(vid, stream, t0_ns, t1_ns, exc)` from any thread, with wall-clock start and end times
  in ns (time.time_ns base) and the exception `work` raised (or None). `mode` (the constants
  below) says how `work` behaves; a vertex of `waits` counts as finished once its `done` has
  returned (cpu) or once the device has executed it (cuda: the stream waits on its event,
  `async_launch`).
- `copy(dst, src)`: an asynchronous-on-the-current-stream byte copy between two views.
- `kernel(op, out, ins, attrs)`: `disco_ray.graph.kernels` implementation of `op` writing `out`
  (attrs already completed with defaults).
- `device`: the torch device of the arena; `close()`.

The CUDA backend (`actors.backend_cuda`) allocates the arena on the GPU, host buffers pinned at
their exact size, maps streams to CUDA streams and launches `work` on all of them from one thread
(`actors.cuda_loop`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

Work = Callable[[int, int], None]
Done = Callable[[int, int, int, int, "BaseException | None"], None]

# how a vertex's `work` behaves (`submit(..., mode)`)
LAUNCH = 0  # it only enqueues (cuda) or runs (cpu): the launching thread runs it
BLOCKING = 1  # it waits on the host (a transfer whose bytes come through a Ray call): run aside
DEFERRED = 2  # it hands its device work to another thread (an NCCL receive, `actors.nccl_channel`),
# which enqueues it later through the backend's `external_begin` / `external_end`


class Backend(Protocol):
    name: str
    device: torch.device

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor: ...

    def open(
        self, streams: int, work: Work, done: Done, workspace: int = 0, kernel_streams: int | None = None
    ) -> None: ...

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), mode: int = LAUNCH) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None: ...

    def close(self) -> None: ...
