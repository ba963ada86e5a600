"""CUDA IPC exports of a worker's arena, one per peer, each released exactly once.

torch's export (`reduce_tensor`, cudaIpcGetMemHandle) wraps the arena's storage in a
producer-side reference count set to 1 (torch/multiprocessing: "CUDA IPC Refcounting"): when the
producer frees the arena while the count is above 0, torch keeps the block (its "limbo") until
`torch.cuda.ipc_collect` finds it at 0. A consumer that rebuilds the tensor (`ipc` pairs)
decrements the count when its copy is freed; one that maps the handle another way (`p2p`,
through CuPy) or never opens it (`nccl`, `ray`) never does, and the count is unsigned: two
consumers of one export wrap it around. Either way the arena would stay on the GPU after
`release_arena`, through every unload and resize. So each peer gets an export of its own
(`ArenaExports.make`); at `connect` the exports of peers that rebuild stay theirs to release and
the others are released here (`settle`), and `close` releases what no consumer took.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

Export = tuple[Any, tuple]  # (rebuild function, its arguments): torch's reduce_tensor, picklable


def export(t: torch.Tensor) -> Export:
    """A CUDA IPC export of `t` (torch's `reduce_tensor`): one more reference count on its memory."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(t)


def release(ex: Export) -> None:
    """Gives back the reference count of export `ex`, as a consumer that rebuilt it does when its
    copy is freed. rebuild_cuda_tensor's arguments: 4 the storage class, 6 the device, 11 and 12
    the reference counter's file and offset."""
    args = ex[1]
    args[4]._release_ipc_counter(args[11], args[12], device=args[6])


def opened_at(ex: Export) -> tuple[Any, int]:
    """(the allocation's cudaIpcMemHandle, the byte offset of the exported tensor in it):
    rebuild_cuda_tensor's arguments 7, and 9 plus 3 (uint8: elements are bytes)."""
    args = ex[1]
    return args[7], args[9] + args[3]


class ArenaExports:
    """The IPC exports of one worker's arena, by peer, and which of them this worker still owes."""

    def __init__(self) -> None:
        self.owed: dict[int, Export] = {}  # peer -> an export no consumer has taken over
        self.made = 0
        self.released = 0
        self.error: str | None = None  # why the last `make` could not export the arena

    def make(self, arena: torch.Tensor, peers: Iterable[int]) -> dict[int, Export] | None:
        """One export per peer (None: this arena cannot be exported, e.g. expandable segments).
        Exports made earlier and not taken over are released first."""
        self.close()
        out: dict[int, Export] = {}
        try:
            for p in peers:
                out[p] = export(arena)
                self.owed[p] = out[p]
                self.made += 1
        except Exception as e:  # no IPC for this arena: whatever was exported goes back
            self.close()
            self.error = f"cannot export its arena for CUDA IPC ({type(e).__name__}: {e})"
            return None
        self.error = None
        return out

    def settle(self, rebuilt_by: Iterable[int]) -> None:
        """The peers `rebuilt_by` rebuild their export (torch releases it when their copy goes);
        every other export is released now."""
        keep = set(rebuilt_by)
        for p in [p for p in self.owed if p not in keep]:
            self._release(p)
        for p in keep:
            self.owed.pop(p, None)

    def close(self) -> None:
        """Releases every export still owed (connect never came, or failed)."""
        for p in list(self.owed):
            self._release(p)

    def _release(self, peer: int) -> None:
        ex = self.owed.pop(peer)
        with contextlib.suppress(Exception):  # at interpreter exit the runtime may be gone already
            release(ex)
            self.released += 1

    def statistics(self) -> dict:
        return {"made": self.made, "released": self.released, "owed": len(self.owed)}
