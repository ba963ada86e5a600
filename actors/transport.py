"""Transports: how a transfer vertex gets its source range from another worker's arena.

A transfer runs on its destination GPU once its source vertex (on the source GPU) has completed;
the MemGraph keeps the source range intact until the transfer completes, so the destination
simply pulls it. `pull(src_gpu, loc, dst, reader, expect)` copies the bytes of `loc` in worker
`src_gpu`'s arena into the uint8 view `dst`; `reader` (the transfer vertex) and `expect` (the
vertex that wrote the range) let the source's sanitizer check the read. `mode(src_gpu)` says how
a pull behaves (`actors.backend`): LAUNCH (it enqueues a copy, or copies, and returns), BLOCKING
(it waits on the host for the bytes), DEFERRED (it registers the receive with a channel that
enqueues it later, in an order agreed with the source: NCCL).

Implemented here: `LocalTransport` (workers in one process: a direct copy) and `RayTransport`
(the destination calls the source actor's `read_range` and copies the returned bytes). The CUDA
transports (`actors.transport_cuda`: CUDA IPC peer copies, NCCL) go behind the same methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc

from .backend import BLOCKING, LAUNCH


class Transport(Protocol):
    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None: ...

    def mode(self, src_gpu: int) -> int:
        """How a pull from `src_gpu` behaves: LAUNCH, BLOCKING or DEFERRED (actors.backend)."""
        ...


@runtime_checkable
class Attaching(Protocol):
    """A transport that is handed its own worker's executor once both are made (the CUDA ones)."""

    def attach(self, executor: Any) -> None: ...


class LocalTransport:
    """Peers are `actors.executor.Executor` objects of this process."""

    def __init__(self, executors: Sequence[Any]):
        self.executors = executors

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        self.executors[src_gpu].read_range(loc, reader, expect, into=dst)

    def mode(self, src_gpu: int) -> int:
        return LAUNCH  # one copy_ call (enqueued on CUDA, done at return on the cpu backend)


class RayTransport:
    """Peers are GpuWorker actor handles; one Ray call per transfer, made from the stream thread."""

    def __init__(self, handles: Sequence[Any]):
        self.handles = handles

    def mode(self, src_gpu: int) -> int:
        return BLOCKING

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            data = ray.get(self.handles[src_gpu].read_range.remote(loc, reader, expect))
        except RayActorError as e:  # its process or node is gone: name the lost worker, not just the reader
            raise RunError(
                f"transfer source gpu:{src_gpu} is lost: its worker died ({type(e).__name__})"
            ) from None
        except RayTaskError as e:  # e.g. the source's sanitizer: pass its message on
            raise RunError(str(e.cause) if getattr(e, "cause", None) is not None else str(e)) from None
        if dst.device.type == "cpu":
            dst.numpy()[...] = data  # the object store hands back a read-only array: copy, don't wrap
        else:
            dst.copy_(torch.from_numpy(data.copy()))
