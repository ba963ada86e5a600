"""The coordinator's dependency core: cross-worker counters, driven by events (no Ray, no threads).

TURNIP (section 5, appendix A) runs one central event loop that launches a vertex once all its
predecessors completed. A Ray call per vertex costs as much as a large kernel (docs/RUNTIME.md,
"Two-level scheduling"), so the loop is split in two levels:

- this core counts, for every vertex, its unfinished predecessors on OTHER workers, and hands a
  vertex to its worker (a `Dispatch`) as soon as that count is zero;
- the worker (`actors.worker_core.WorkerCore`) counts the predecessors on its own GPU and
  releases the vertex locally when they are done too.

So a chain on one worker runs with no round trip, every worker gets all its vertices without
remote predecessors at `start()`, and only cross-worker edges and batched completion reports go
through the coordinator. Alternatives rejected: one central counter per vertex (a round trip per
vertex) and workers signalling each other directly (no single place that knows the end, the
held vertices of a dead worker, or the progress).

Like dask's worker state machine, `handle(event)` returns a list of instructions for the shell
(a Ray actor, or the local engine) to carry out; tests drive it with hand-made events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from disco_ray.graph.memgraph import MemGraph

# ---- events (shell -> core) ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completed:
    """Worker `gpu` finished the vertices `vids` (a batch, in any order)."""

    gpu: int
    vids: tuple[int, ...] | list[int]


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """Worker `gpu` cannot go on: a vertex raised (vid set) or the worker died (vid None)."""

    gpu: int
    vid: int | None
    message: str


# ---- instructions (core -> shell) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Hand `vids` (sorted by id) to worker `gpu`: their remote predecessors have all completed."""

    gpu: int
    vids: list[int]


@dataclass(frozen=True, slots=True)
class Finished:
    """Every vertex has completed: the run is over."""


@dataclass(frozen=True, slots=True)
class Abort:
    """The run failed; `message` names the worker and the vertex."""

    message: str


Event = Completed | WorkerFailed
Instruction = Dispatch | Finished | Abort


class RunState(str, Enum):
    """Where a run is: IDLE -> RUNNING -> FINISHED | FAILED (a str: `statistics()` reports it)."""

    IDLE = "idle"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class Scheduler:
    """Cross-worker dependency counters of one MemGraph; reusable for many runs (`start` resets)."""

    def __init__(self, mg: MemGraph):
        self.gpus = mg.gpus
        self.gpu_of: dict[int, int] = {v.id: v.gpu for v in mg.vertices}
        self.n = len(mg.vertices)
        remote_preds: dict[int, int] = dict.fromkeys(self.gpu_of, 0)
        self.remote_succs: dict[int, list[int]] = {}
        for u, w in dict.fromkeys((e[0], e[1]) for e in mg.edges):
            if self.gpu_of[u] != self.gpu_of[w]:
                remote_preds[w] += 1
                self.remote_succs.setdefault(u, []).append(w)
        self._remote_preds0 = remote_preds
        self.per_gpu = [0] * self.gpus
        for g in self.gpu_of.values():
            self.per_gpu[g] += 1
        self._reset()

    def _reset(self) -> None:
        self.left = dict(self._remote_preds0)
        self.held: list[set[int]] = [set() for _ in range(self.gpus)]  # dispatched, not completed
        self.completed = 0
        self.state = RunState.IDLE
        self.error: str | None = None
        self.events = 0
        self.dispatch_msgs = 0

    def start(self) -> list[Instruction]:
        """Resets the counters and dispatches every vertex without remote predecessors."""
        self._reset()
        self.state = RunState.RUNNING
        if self.n == 0:
            self.state = RunState.FINISHED
            return [Finished()]
        return self._dispatch(v for v, k in self.left.items() if k == 0)

    def handle(self, event: Event) -> list[Instruction]:
        """Applies one event; returns what the shell must do."""
        self.events += 1
        if self.state is not RunState.RUNNING:
            return []  # late reports after the end or a failure change nothing
        if isinstance(event, WorkerFailed):
            self.state = RunState.FAILED
            self.error = event.message
            return [Abort(event.message)]
        held = self.held[event.gpu]
        ready: list[int] = []
        for vid in event.vids:
            if vid not in held:
                self.state = RunState.FAILED
                self.error = f"gpu:{event.gpu} reported vertex {vid} done, which it was not holding"
                return [Abort(self.error)]
            held.remove(vid)
            for w in self.remote_succs.get(vid, ()):
                k = self.left[w] - 1
                self.left[w] = k
                if k == 0:
                    ready.append(w)
        self.completed += len(event.vids)
        out = self._dispatch(ready) if ready else []
        if self.completed == self.n:
            self.state = RunState.FINISHED
            out.append(Finished())
        return out

    def _dispatch(self, vids: Iterable[int]) -> list[Instruction]:
        by_gpu: dict[int, list[int]] = {}
        for v in vids:
            by_gpu.setdefault(self.gpu_of[v], []).append(v)
        out: list[Instruction] = []
        for g, vs in sorted(by_gpu.items()):
            vs.sort()
            self.held[g].update(vs)
            out.append(Dispatch(g, vs))
        self.dispatch_msgs += len(out)
        return out

    def held_by(self, gpu: int) -> list[int]:
        """Vertices handed to `gpu` and not reported done (named when the worker dies)."""
        return sorted(self.held[gpu])

    def statistics(self) -> dict:
        return {
            "vertices": self.n,
            "completed": self.completed,
            "state": self.state.value,
            "events": self.events,
            "dispatch_messages": self.dispatch_msgs,
            "cross_worker_edges": sum(len(s) for s in self.remote_succs.values()),
        }
