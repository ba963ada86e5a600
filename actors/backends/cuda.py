"""The CUDA backend: one arena on the GPU, pinned host buffers, S CUDA streams, one host thread.

`open` makes the streams (the executor's compute streams and its copy lanes) and the host
threads of `actors.backends.cuda_loop`: one loop launches every stream's vertices and finds their
completions, wakers wake it when it sleeps, helpers run work that blocks the host, and a channel
(`actors.transports.nccl`) enqueues deferred NCCL receives through `external_begin/end`.

Copies run on the lanes the executor submits them to (`actors.slots.StreamSlots`): one
lane per direction between host and device, one per peer sending to this GPU. A lane is FIFO and
the loop launches in submission order (the executor submits lowest id first, i.e. the planner's
order), so loads enter the H2D lane in that order. Measured on the H100 (bench_gpu_chain):
loads issued on several streams run concurrently and share PCIe, so each finishes late and the
matmul waiting for the first one starts late (1.26x the lower bound for the weight-streaming
chain); in launch order the first load gets all the bandwidth, as in a hand-written prefetch loop.

Times: the interval of a vertex is measured on the GPU (two timing events around its work, the
start one recorded after its waits, so time queued behind earlier work on its stream is not
counted as busy); its end is the wall-clock instant given by a base event synchronized against
the host clock when the loop is idle (`actors.backends.cuda_loop.Clock`). The events are made once per
vertex (the first time it runs) and kept for later runs. `statistics()["host"]` sums, since
`open`, the host time spent in `work` per vertex and the time the loop slept with vertices in
flight: a mean launch time above the device time of a vertex, with little idle time, means the
host, not the GPU, sets the pace.

Memory (`actors.backends.cuda_memory`): nothing is allocated while a graph runs. The arena and
every host buffer come once from `alloc` (host buffers pinned at their exact size with
cudaHostRegister, not through torch's power-of-two caching host allocator); `open` reserves, on
each compute stream, the kernel temporaries the executor says its kernels need (at least
DISCO_CUDA_WORKSPACE bytes, default 16 MiB) and cuBLAS's workspace. The streams come from
the process's free streams (`take_streams`) and go back at `close`: torch keeps a cuBLAS
workspace per stream until the process ends, so streams made per graph would keep memory that
no unload gives back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.kernels import IMPLS

from . import cuda_memory
from .base import BackendBase, Done, Mode, Work
from .cuda_loop import CudaLoop

SLACK = 2 << 20  # torch's allocator rounds and splits blocks: a little over the sum of the temporaries

_FREE_STREAMS: dict[torch.device, list] = {}  # per device, the process's streams no backend holds
_STREAMS_LOCK = threading.Lock()


def take_streams(device: torch.device, n: int) -> list:
    """`n` CUDA streams of `device` for one backend, from those an earlier backend of this process
    gave back (`give_streams`), made only when none is free. torch keeps a cuBLAS workspace for
    each stream a matmul ran on (32 MiB on an H100) until the process ends, and no unload can free
    it: with new streams per graph, each load left 64 MiB per worker on the device after its
    unload (tests/test_gpu.py, on an H100). No two open backends hold the same stream."""
    with _STREAMS_LOCK:
        free = _FREE_STREAMS.setdefault(device, [])
        got = [free.pop() for _ in range(min(n, len(free)))]
    with torch.cuda.device(device):
        got += [torch.cuda.Stream(device) for _ in range(n - len(got))]
    return got


def give_streams(device: torch.device, streams: list) -> None:
    """Streams a closed backend no longer uses (all their work done), for the next `take_streams`."""
    with _STREAMS_LOCK:
        _FREE_STREAMS.setdefault(device, []).extend(reversed(streams))


class CudaBackend(BackendBase):
    """Arena on `device` (default: the current CUDA device), pinned host buffers, CUDA streams."""

    name = "cuda"
    stages_inputs = True  # the executor copies graph inputs into a pinned buffer from `alloc`
    async_launch = True  # `work` only enqueues: it has not run when it returns
    default_ahead = 4  # the host prepares the next kernels of a chain while the device runs

    def __init__(self, device: int | str | torch.device | None = None, workspace: int | None = None):
        if not torch.cuda.is_available():
            raise RunError("backend 'cuda': torch sees no CUDA device")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        self.floor = int(os.environ.get("DISCO_CUDA_WORKSPACE", 16 << 20)) if workspace is None else workspace
        self.streams: list = []
        self.loop: CudaLoop | None = None
        self.allocated = {"device": 0, "pinned": 0}
        self.reserved = 0  # bytes of kernel temporaries kept ready per compute stream
        self._host = [0, 0, 0, 0]

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        """One uint8 buffer of exactly `nbytes`: pinned host memory (host=True) or device memory."""
        if host:
            self.allocated["pinned"] += nbytes
            return cuda_memory.pinned(nbytes)
        self.allocated["device"] += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def open(
        self, streams: int, work: Work, done: Done, workspace: int = 0, kernel_streams: int | None = None
    ) -> None:
        """`streams` CUDA streams and the loop's threads. The first `kernel_streams` (default: all)
        run kernels: each keeps `workspace` bytes (the largest temporaries of one kernel, at least
        the floor) and cuBLAS's workspace ready; the others are copy lanes."""
        self.close()
        self.streams = take_streams(self.device, streams)
        self.reserved = max(self.floor, workspace + SLACK if workspace else 0)
        compute = self.streams[: streams if kernel_streams is None else kernel_streams]

        def warm() -> None:
            for stream in compute:
                cuda_memory.reserve(stream, self.device, self.reserved)

        self.loop = CudaLoop(self.device, self.streams, work, done, warm)
        self._host = self.loop.host
        torch.cuda.synchronize(self.device)
        if self.loop.error is not None:
            err = self.loop.error
            self.close()
            raise RunError(f"backend 'cuda' on {self.device}: warming up the streams failed: {err}")

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), mode: Mode = Mode.LAUNCH) -> None:
        assert self.loop is not None, "submit before open"
        self.loop.submit(stream, vid, waits, mode)

    # ---- what a deferred vertex's thread calls (actors.transports.nccl) ------------------------
    def external_begin(self, vid: int) -> Any:
        """The stream of DEFERRED vertex `vid`, after its waits and start event."""
        assert self.loop is not None
        return self.loop.external_begin(vid)

    def external_end(self, vid: int, exc: BaseException | None = None) -> None:
        assert self.loop is not None
        self.loop.external_end(vid, exc)

    def stream(self, s: int) -> Any:
        return self.streams[s]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """On the current stream (the vertex's lane); asynchronous between pinned host memory and
        the device."""
        dst.copy_(src, non_blocking=True)

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
        IMPLS[op](out, ins, attrs)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
            self.loop = None
        if self.streams:
            torch.cuda.synchronize(self.device)
            give_streams(self.device, self.streams)
        self.streams = []

    @property
    def _threads(self) -> list:
        return [] if self.loop is None else list(self.loop.threads)

    def statistics(self) -> dict:
        return {
            "backend": self.name,
            "device": str(self.device),
            "streams": len(self.streams),
            **self.allocated,
            "workspace_per_stream": self.reserved,
            "host": host_statistics(*self._host),
        }


def host_statistics(launches: int, launch_ns: int, idle_ns: int, blocking: int) -> dict:
    """The loop's counters: vertices launched, host time in the `work` of those it ran itself,
    time asleep with vertices in flight (the host waiting on the device), vertices a helper or
    the channel ran."""
    own = launches - blocking
    return {
        "launches": launches,
        "launch_s": launch_ns / 1e9,
        "launch_us_mean": launch_ns / own / 1e3 if own else 0.0,
        "idle_s": idle_ns / 1e9,
        "blocking": blocking,
    }
