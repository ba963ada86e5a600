"""The contract of a tier below a worker's host store (MemGraph locations `{"device": "disk"}`).

The executor offloads to it and reloads from it (`SpillTier`) and, so that a reload does not put
the tier's latency on the critical path, has a `ReloadAhead` read the plan's upcoming reloads
into staging buffers. Both are made at load time (on the loading thread) only for a worker whose
plan uses the tier. Threads: `write` and `read` run inside a vertex's work on the disk lanes'
stream threads (`actors.executor`: one offload and one reload at a time); the others on the
thread that starts, ends or closes a run. Implemented by `actors.tiers.spill`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

Copy = Callable[[torch.Tensor, torch.Tensor], object]  # (dst, src): the backend's `copy`


class SpillTier(Protocol):
    """A worker's byte-addressed store below host memory; offsets are the MemGraph's."""

    nbytes: int  # its size (the sanitizer tracks its ranges)

    def write(self, offset: int, src: torch.Tensor) -> None:
        """An offload: the uint8 range `src` (arena bytes) goes to `offset`. It may return before
        the bytes are in (write behind) but `src` is free to reuse when it returns."""
        ...

    def read(self, offset: int, dst: torch.Tensor, copy: Copy) -> None:
        """A reload: `dst.numel()` bytes at `offset` into the uint8 range `dst` (with `copy` where
        `dst` is device memory); sees every `write` handed over before it."""
        ...

    def flush(self) -> None:
        """Waits until every write is in (at a run's start and end).

        Raises:
            RunError: a write behind failed.
        """
        ...

    def reset(self) -> None:
        """A new run: zeroes the counters (after `flush`)."""
        ...

    def statistics(self) -> dict:
        """This run's I/O: bytes, seconds, rates each way."""
        ...

    def close(self) -> None:
        """The graph is unloaded: finishes the writes and frees the tier's storage."""
        ...


class ReloadAhead(Protocol):
    """Reads the plan's reloads from a `SpillTier` ahead of their vertices."""

    def begin(self) -> None:
        """A run starts: nothing is written or read ahead yet."""
        ...

    def written(self, offload: int) -> None:
        """Offload vertex `offload` has handed its bytes to the tier in this run (its reloads may
        now be read); on its disk lane's stream thread."""
        ...

    def take(self, reload: int, dst: torch.Tensor, copy: Copy) -> bool:
        """Copies reload `reload`'s bytes into `dst` when they were read ahead (True); else False,
        and the caller reads the tier itself. On the reload's stream thread."""
        ...

    def end(self) -> None:
        """The run is over or failed: reading ahead stops, the staging buffers go back."""
        ...

    def statistics(self) -> dict: ...

    def close(self) -> None: ...
