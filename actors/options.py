"""The settings of the runtime: `RunOptions` (one run, any engine) and `WorkerConfig` (how every
worker of a Program runs its vertices, given once to each engine and worker)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from disco_ray.graph.errors import RunError


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The settings of one run, taken by every engine."""

    check: bool = False  # the sanitizer: every read checks its writer (actors/sanitizer.py)
    delay: tuple[float, float] | None = None  # debug: sleep uniform(lo, hi) s before each vertex
    seed: int = 0  # seeds the delays
    timeout: float | None = None  # give up (RunError) after this many seconds; None: never
    progress: Callable[[int], None] | None = None  # called with the number of vertices done


DEFAULT_RUN = RunOptions()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How every worker of a Program runs its vertices (given once, to each engine and worker)."""

    backend: str = "cpu"  # a name of `actors.backends.make_backend`: "cpu" or "cuda"
    streams: int = 5  # streams per GPU
    ahead: int | None = None  # kernels launched ahead per stream; None: the backend's default
    flush_s: float = 1e-3  # longest a busy worker holds back a completion another GPU waits for
    lazy_s: float = 0.05  # longest it may hold back the others (see actors/reporter.py)
    sources: str = "host"  # sourced inputs: "host" (read once, kept) or "disk" (read at each load)
    disk_dir: str | None = None  # where a worker whose plan spills makes its spill file (None: a temp dir)

    def __post_init__(self) -> None:
        if self.sources not in ("host", "disk"):
            raise RunError(f"sources must be 'host' or 'disk', got {self.sources!r}")
        if self.streams < 1:
            raise RunError(f"streams must be >= 1, got {self.streams}")
        if self.ahead is not None and self.ahead < 0:
            raise RunError(f"ahead must be >= 0, got {self.ahead}")


DEFAULT_WORKER = WorkerConfig()
