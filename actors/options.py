"""The settings of the runtime: `RunOptions` (one run, any engine) and `WorkerConfig` (how every
worker of a Program runs its vertices, given once to each engine and worker)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from disco_ray.graph.errors import RunError

# a Ray actor that leaves a heartbeat unanswered this long is stopped or hung (SIGSTOP, a deadlock):
# the run ends naming it; a computing actor answers (its pings run on another thread)
STALL_S = 10.0


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The settings of one run, taken by every engine."""

    check: bool = False  # the sanitizer: every read checks its writer (actors/sanitizer.py)
    delay: tuple[float, float] | None = None  # debug: sleep uniform(lo, hi) s before each vertex
    seed: int = 0  # seeds the delays
    timeout: float | None = None  # give up (RunError) after this many seconds; None: never
    progress: Callable[[int], None] | None = None  # called with the number of vertices done
    stall_timeout: float = STALL_S  # ray engine: an actor silent this many seconds ends the run

    def __post_init__(self) -> None:
        if not (isinstance(self.stall_timeout, (int, float)) and math.isfinite(self.stall_timeout)):
            raise RunError(f"stall_timeout must be a number of seconds, got {self.stall_timeout!r}")
        if self.stall_timeout <= 0:
            raise RunError(f"stall_timeout must be > 0 seconds, got {self.stall_timeout}")


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
