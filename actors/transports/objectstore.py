"""`RayTransport`: the destination calls the source actor's `read_range` and copies the bytes it
returns through Ray's object store (every backend; the cuda transport's fallback).

Every wait for a source is bounded: by what is left of the run's timeout (`set_timeout`, from
the run's `RunOptions.timeout`), else by PULL_TIMEOUT_S per pull, so a source that never answers
(stopped, hung, its node cut off) ends the run with an error naming it instead of holding the
helper thread that runs the pull for ever.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc

from ..backends.base import Mode
from .base import TransportBase

PULL_TIMEOUT_S = 300.0  # a pull of a run without a timeout waits this long for its source


class RayTransport(TransportBase):
    """Peers are GpuWorker actor handles; one Ray call per transfer, made from the stream thread."""

    def __init__(self, handles: Sequence[Any]):
        self.handles = handles
        self.timeout_s: float | None = None  # the run's
        self.deadline: float | None = None  # monotonic: when the run's timeout has passed

    def mode(self, src_gpu: int) -> Mode:
        return Mode.BLOCKING

    def set_timeout(self, seconds: float | None) -> None:
        self.timeout_s = seconds
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        ref = self.handles[src_gpu].read_range.remote(loc, reader, expect)
        bound = PULL_TIMEOUT_S if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            data = ray.get(ref, timeout=bound)
        except GetTimeoutError:
            ray.cancel(ref)
            within = (
                f"the run's timeout of {self.timeout_s:g} s" if self.deadline is not None else f"{bound:g} s"
            )
            raise RunError(
                f"transfer {reader}: its source gpu:{src_gpu} did not answer within {within} "
                "(stopped, hung or cut off)"
            ) from None
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
