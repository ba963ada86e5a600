"""`LocalTransport`: the workers are executors of this process (the local engine): a direct copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from disco_ray.graph.memgraph import Loc

from ..backends.base import Mode
from .base import TransportBase


class LocalTransport(TransportBase):
    """Peers are `actors.executor.Executor` objects of this process."""

    def __init__(self, executors: Sequence[Any]):
        self.executors = executors

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        self.executors[src_gpu].read_range(loc, reader, expect, into=dst)

    def mode(self, src_gpu: int) -> Mode:
        return Mode.LAUNCH  # one copy_ call (enqueued on CUDA, done at return on the cpu backend)
