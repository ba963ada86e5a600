"""`RayTransport`: the destination calls the source actor's `read_range` and copies the bytes it
returns through Ray's object store (every backend; the cuda transport's fallback)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc

from ..backends.base import Mode
from .base import TransportBase


class RayTransport(TransportBase):
    """Peers are GpuWorker actor handles; one Ray call per transfer, made from the stream thread."""

    def __init__(self, handles: Sequence[Any]):
        self.handles = handles

    def mode(self, src_gpu: int) -> Mode:
        return Mode.BLOCKING

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
