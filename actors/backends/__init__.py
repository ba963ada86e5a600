"""Backends by name: `make_backend("cpu")`, and `register_backend` for one's own.

A new backend is one module with a class that subclasses `actors.backends.base.BackendBase` and
implements the `Backend` protocol, plus one `register_backend(name, factory)` call; the name is
then valid in `WorkerConfig(backend=...)` in any process that made that call (the workers too:
name its module in `op_modules`).
"""

from __future__ import annotations

from collections.abc import Callable

from disco_ray.graph.errors import UsageError

from .base import Backend

Factory = Callable[[int | None], Backend]  # (CUDA device index or None) -> a new backend

BACKENDS: dict[str, Factory] = {}  # name -> factory (`register_backend`)


def register_backend(name: str, factory: Factory) -> None:
    """Makes `make_backend(name, device)` call `factory(device)` (replacing an earlier one)."""
    BACKENDS[name] = factory


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def make_backend(name: str, device: int | None = None) -> Backend:
    """A new backend called `name` (`device`: the CUDA device index to use, None: the current).

    Raises:
        UsageError: an unknown name, or one whose module this build cannot import.
    """
    factory = BACKENDS.get(name)
    if factory is None:
        raise UsageError(f"unknown backend {name!r} ({' or '.join(backend_names())})")
    return factory(device)


def _cpu(device: int | None) -> Backend:
    from .cpu import CpuBackend

    return CpuBackend()


def _cuda(device: int | None) -> Backend:
    try:  # imported when asked for: a CPU build has no CUDA to bind
        from .cuda import CudaBackend
    except ImportError:
        raise UsageError("backend 'cuda' is not available in this build (use --backend cpu)") from None
    return CudaBackend(device)


register_backend("cpu", _cpu)
register_backend("cuda", _cuda)
