"""A stand-in for torch's CUDA IPC export and CuPy's IPC mapping, on the stand-in device of
tests/fake_cuda.py (device memory is host memory of this process).

It keeps torch's producer-side reference count (torch/multiprocessing, "CUDA IPC Refcounting"):
an export holds the exported memory, whatever the producer frees, until its count is back at 0;
the count is 1 at export and goes down once when a consumer that rebuilt the tensor drops it, or
when `_release_ipc_counter` is called. torch's count is unsigned, so a second release of one
export wraps it around and the memory stays for ever: here it is recorded in `ERRORS`.

`install(setattr)` puts it under `actors.transports.ipc` and `actors.transports.cuda`
(`cupy_runtime`: `ipcOpenMemHandle` maps to the exported bytes, `memcpyAsync` copies them).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import torch

_lock = threading.Lock()
HELD: dict[int, torch.Tensor] = {}  # export handle -> the exported tensor, while its count is above 0
COUNTS: dict[int, int] = {}  # export handle -> its reference count
ADDRESS: dict[int, int] = {}  # export handle -> the exported bytes' address (the allocation's handle)
_handles = itertools.count(1)


ERRORS: list[str] = []  # second releases (raised in a finalizer, an assertion would only be printed)


def _decrement(k: int) -> None:
    with _lock:
        if COUNTS.get(k, 0) <= 0:  # torch's unsigned count would wrap: the memory held for ever
            ERRORS.append(f"IPC export {k} released more often than it was exported")
            return
        COUNTS[k] -= 1
        if COUNTS[k] == 0:
            del HELD[k]


class _Storage:
    """The storage class in an export's arguments (argument 4), as torch's TypedStorage."""

    @staticmethod
    def _release_ipc_counter(handle: int, offset: int, device=None) -> None:
        _decrement(handle)


def _rebuild(*args) -> torch.Tensor:
    """A consumer's copy of the export: dropping it gives the count back, as torch's does."""
    k = args[7]
    with _lock:
        t = HELD[k].view(HELD[k].shape)
    weakref.finalize(t, _decrement, k)
    return t


def export(t: torch.Tensor) -> tuple[Callable, tuple]:
    """torch's `reduce_tensor` of a device tensor: (rebuild, its 15 arguments, in torch's places)."""
    k = next(_handles)
    with _lock:
        HELD[k], COUNTS[k], ADDRESS[k] = t, 1, t.data_ptr()
    args: list = [None] * 15
    args[3], args[4], args[6], args[7], args[9], args[11], args[12] = 0, _Storage, "cuda:0", k, 0, k, 0
    return _rebuild, tuple(args)


def _open(handle: int, flags: int) -> int:
    """A mapping of the allocation: valid while the producer holds it, whatever the count."""
    with _lock:
        return ADDRESS[handle]


def runtime() -> SimpleNamespace:
    """CuPy's runtime for the p2p path: a mapping is the exported bytes' address."""
    return SimpleNamespace(
        ipcOpenMemHandle=_open,
        ipcCloseMemHandle=lambda base: None,
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n),
    )


def live_exports() -> int:
    """Exports still holding memory (count above 0)."""
    with _lock:
        return len(HELD)


def install(set_attr: Callable[[object, str, object], None] = setattr) -> None:
    from actors.transports import cuda, ipc

    set_attr(ipc, "export", export)
    set_attr(cuda, "cupy_runtime", runtime)
