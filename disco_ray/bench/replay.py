"""A run replayed: the durations and host costs measured in its trace, as a cost model.

The traces of runs (`disco_ray.graph.trace`: per GPU, records (vertex, stream, start ns, end ns))
give each vertex's duration, the interquartile mean over the runs (a path's length adds
durations, so its expectation adds their means; the quartiles drop runs another job stalled),
and the host's lags: the median gap from a vertex's end to the start of a successor it released
on its GPU, on the same stream (the executor's `_done`) and on another (its thread woken too).
Medians there, since those gaps also hold waits the simulator models itself (a full lane, a busy
stream), which a mean would count twice. Fed to `disco_ray.bench.simulate.simulate` with the
reporter's settings of the runs, they predict their makespan (benchmarks/bench_simulate.py
compares the two), and they let the simulator's schedule be checked against the runtime's.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import MemGraph, MemVertex
from disco_ray.graph.taskgraph import Vertex

from .sim_engine import Host

Records = Sequence[Sequence[tuple[int, int, int, int]]]  # one run: per GPU (vid, stream, t0 ns, t1 ns)


@dataclass(frozen=True, slots=True)
class Replay:
    """Measured seconds per vertex id; streams and launch ahead as the run had them."""

    seconds: Mapping[int, float] = field(default_factory=dict)
    streams: int = 5
    ahead: int = 0  # the cpu backend's default
    # every stream runs on its own: a measured duration already includes the sharing of the
    # device (here: the cores) with what ran beside it
    overlap: bool = True
    name: str = "replay"

    def time(self, v: MemVertex, tv: Vertex | None, in_shapes: list[tuple[int, ...]]) -> float:
        try:
            return self.seconds[v.id]
        except KeyError:
            raise UsageError(f"the replayed trace has no record of vertex {v.id} ({v.value})") from None


def durations(runs: Sequence[Records]) -> dict[int, float]:
    """Vertex id -> the mean over `runs` of its measured seconds, less the lowest and highest
    quarter."""
    got: dict[int, list[float]] = {}
    for records in runs:
        for recs in records:
            for vid, _, t0, t1 in recs:
                got.setdefault(vid, []).append((t1 - t0) / 1e9)
    return {vid: statistics.fmean(_middle(ts)) for vid, ts in got.items()}


def _middle(xs: list[float]) -> list[float]:
    xs = sorted(xs)
    k = len(xs) // 4
    return xs[k : len(xs) - k]


def host_lags(mg: MemGraph, runs: Sequence[Records]) -> tuple[float, float]:
    """(done_s, wake_s) of `Host`: the median gap from a vertex's end to the start of a successor
    on its GPU whose predecessors (all on that GPU) it finished last, when the successor ran on
    the same stream (the completion's host time), and when it ran on another (less that: the
    time to wake that stream's thread); 0 where no vertex has one."""
    preds: dict[int, list[int]] = {v.id: [] for v in mg.vertices}
    for u, w, _ in mg.edges:
        preds[w].append(u)
    gpu = {v.id: v.gpu for v in mg.vertices}
    same: list[int] = []
    other: list[int] = []
    for records in runs:
        at = {vid: (s, t0, t1) for recs in records for vid, s, t0, t1 in recs}
        for w, ps in preds.items():
            if not ps or w not in at or any(gpu[p] != gpu[w] for p in ps):
                continue
            u = max(ps, key=lambda p: at[p][2])
            (same if at[u][0] == at[w][0] else other).append(at[w][1] - at[u][2])
    done = statistics.median(same) / 1e9 if same else 0.0
    wake = statistics.median(other) / 1e9 - done if other else 0.0
    return done, max(wake, 0.0)


def makespan(records: Records) -> float:
    """Seconds from the first start to the last end of a run's records."""
    spans = [(t0, t1) for recs in records for _, _, t0, t1 in recs]
    if not spans:
        return 0.0
    return (max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)) / 1e9


def replay(
    mg: MemGraph,
    runs: Sequence[Records],
    streams: int = 5,
    ahead: int = 0,
    flush_s: float = 1e-3,
    lazy_s: float = 0.05,
    report_s: float = 0.0,
) -> tuple[Replay, Host]:
    """The cost model and the host of `runs` of `mg` (made with these WorkerConfig settings;
    `report_s`: the host time of a report call, which the runtime measures itself, the workers'
    statistics' `report_call_ms`)."""
    done, wake = host_lags(mg, runs)
    return Replay(durations(runs), streams, ahead), Host(done, wake, flush_s, lazy_s, report_s)
