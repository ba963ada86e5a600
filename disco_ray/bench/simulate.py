"""Discrete-event simulation of a MemGraph under a cost model (no Ray, no GPU).

The simulated runtime is the papers' work-conserving event loop (DISCO §1, appendix): a vertex
starts as soon as all its predecessors have finished, a stream of its GPU is free (S per GPU) and
its lane is free (one kernel at a time on `compute`, one copy at a time on each of `h2d`, `d2h`,
`peer`); among the vertices that could start, the lowest id goes first. Durations come from the
cost model (`disco_ray.bench.profiles`). It predicts makespans, and it checks the papers' worked example
(levelwise 3n units, work-conserving 2n+1) exactly.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from disco_ray.graph.errors import GraphError
from disco_ray.graph.memgraph import MemGraph, MKind
from disco_ray.graph.taskgraph import TaskGraph

from .profiles import LANES, Profile, UnitCost, lane


@dataclass(frozen=True, slots=True)
class SimResult:
    """Makespan, per-GPU busy fraction of each lane, and a timeline of (vertex, gpu, lane, start, end)."""

    makespan: float
    busy: list[dict[str, float]]  # per GPU: lane -> busy time / makespan
    timeline: list[tuple[int, int, str, float, float]]
    profile: str = ""
    stats: dict = field(default_factory=dict)

    def statistics(self) -> dict:
        return {
            "makespan": self.makespan,
            "profile": self.profile,
            "vertices": len(self.timeline),
            "busy": self.busy,
            **self.stats,
        }

    def span(self, vid: int) -> tuple[float, float]:
        """(start, end) of vertex `vid`."""
        for v, _, _, s, e in self.timeline:
            if v == vid:
                return s, e
        raise KeyError(vid)


def simulate(mg: MemGraph, tg: TaskGraph, cost: Profile | UnitCost, streams: int | None = None) -> SimResult:
    """Runs `mg` (planned from `tg`) in simulated time; GraphError if it deadlocks (a cycle).

    Args:
        mg: the MemGraph; its ids give the priority (lowest first).
        tg: the TaskGraph it was planned from (kernels' ops and shapes).
        cost: a device profile or the unit cost model.
        streams: streams per GPU; defaults to the cost model's.
    """
    n = len(mg)
    S = streams if streams is not None else cost.streams
    if S < 1:
        raise ValueError(f"streams must be >= 1, got {S}")
    gpus = mg.gpus
    dur = [_duration(v, tg, cost) for v in mg.vertices]
    lanes = [LANES.index(lane(v)) for v in mg.vertices]
    gpu = [v.gpu for v in mg.vertices]
    ids = [v.id for v in mg.vertices]
    succs = mg.succs()
    indeg = [0] * n
    for ss in succs:
        for w in ss:
            indeg[w] += 1
    # per GPU and lane: heap of (id, position)
    ready: list[list[list[tuple[int, int]]]] = [[[] for _ in LANES] for _ in range(gpus)]
    lane_busy = [[False] * len(LANES) for _ in range(gpus)]
    free = [S] * gpus
    events: list[tuple[float, int, int]] = []  # (end time, sequence, position)
    seq = 0
    start = [0.0] * n
    busy = [[0.0] * len(LANES) for _ in range(gpus)]

    for p in range(n):
        if indeg[p] == 0:
            heapq.heappush(ready[gpu[p]][lanes[p]], (ids[p], p))

    def dispatch(g: int, now: float) -> None:
        nonlocal seq
        while free[g]:
            best = None
            for li, h in enumerate(ready[g]):
                if h and not lane_busy[g][li] and (best is None or h[0] < ready[g][best][0]):
                    best = li
            if best is None:
                return
            _, p = heapq.heappop(ready[g][best])
            lane_busy[g][best] = True
            free[g] -= 1
            start[p] = now
            busy[g][best] += dur[p]
            seq += 1
            heapq.heappush(events, (now + dur[p], seq, p))

    now = 0.0
    for g in range(gpus):
        dispatch(g, now)
    done = 0
    while events:
        now = events[0][0]
        touched = set()
        while events and events[0][0] == now:
            _, _, p = heapq.heappop(events)
            done += 1
            g = gpu[p]
            lane_busy[g][lanes[p]] = False
            free[g] += 1
            touched.add(g)
            for w in succs[p]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    heapq.heappush(ready[gpu[w]][lanes[w]], (ids[w], w))
                    touched.add(gpu[w])
        for g in sorted(touched):
            dispatch(g, now)
    if done != n:
        stuck = next(p for p in range(n) if indeg[p] > 0)
        raise GraphError(
            f"simulation deadlocked: vertex {ids[stuck]} never became ready "
            f"({done} of {n} vertices ran; the MemGraph has a cycle)"
        )
    makespan = max((start[p] + dur[p] for p in range(n)), default=0.0)
    frac = [
        {ln: (busy[g][i] / makespan if makespan > 0 else 0.0) for i, ln in enumerate(LANES)}
        for g in range(gpus)
    ]
    timeline = [(ids[p], gpu[p], LANES[lanes[p]], start[p], start[p] + dur[p]) for p in range(n)]
    timeline.sort(key=lambda e: (e[3], e[0]))
    kinds: dict[str, int] = {k.value: 0 for k in MKind}
    for v in mg.vertices:
        kinds[v.kind.value] += 1
    return SimResult(
        makespan,
        frac,
        timeline,
        getattr(cost, "name", ""),
        {"streams": S, "by_kind": kinds, "work": sum(dur)},
    )


def _duration(v, tg: TaskGraph, cost) -> float:
    tv = tg[v.value] if v.kind is MKind.KERNEL else None
    if tv is not None and v.acc is not None:  # a sum-into kernel adds one operand into the sum
        return float(cost.time(v, tv, [tv.shape, tg[v.ins[0].value].shape]))
    shapes = [tg[i].shape for i in tv.inputs] if tv is not None else []
    return float(cost.time(v, tv, shapes))


def plot_timeline(result: SimResult, path: str | None = None, ax=None, labels: dict[int, str] | None = None):
    """Draws the timeline as one row per (GPU, lane); saves it to `path` when given. Returns the axes."""
    import matplotlib

    if path is not None and ax is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({(g, ln) for _, g, ln, _, _ in result.timeline}, key=lambda r: (r[0], LANES.index(r[1])))
    row = {r: i for i, r in enumerate(rows)}
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.4 * len(rows)))
    colors = {"compute": "tab:blue", "h2d": "tab:orange", "d2h": "tab:green", "peer": "tab:purple"}
    for vid, g, ln, s, e in result.timeline:
        if e > s:
            ax.broken_barh(
                [(s, e - s)], (row[(g, ln)] - 0.4, 0.8), color=colors[ln], edgecolor="black", lw=0.3
            )
            if labels and vid in labels:
                ax.text((s + e) / 2, row[(g, ln)], labels[vid], ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)), [f"gpu{g} {ln}" for g, ln in rows])
    ax.set_xlabel("time")
    ax.set_title(f"makespan {result.makespan:.4g} ({result.profile})")
    if path is not None:
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=120)
    return ax
