"""Discrete-event simulation of a MemGraph under a cost model (no Ray, no GPU, no threads).

The simulated runtime is the runtime itself: `disco_ray.bench.sim_engine` drives the
coordinator's and the workers' own cores (`actors.scheduler`, `actors.worker_core`), their lane
rule (`actors.lanes`: compute streams, a host-to-device and a device-to-host lane, a lane per
peer, disk lanes; a copy depth of 2) and launch ahead, on a simulated clock: a worker launches
its ready vertices lowest id first, and each engine of a GPU (compute, each copy direction) runs
what was launched in launch order. Durations come from the cost model (`disco_ray.bench.profiles`, or a trace replayed: `disco_ray.bench.replay`). It predicts
makespans, and it checks the papers' worked example (levelwise 3n units, work-conserving 2n+1)
exactly. docs/RUNTIME.md, "The simulator", says how it works.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disco_ray.graph.memgraph import MemGraph, MKind
from disco_ray.graph.taskgraph import TaskGraph

from .profiles import LANES, Profile, UnitCost
from .replay import Replay
from .sim_engine import Host, SimEngine


@dataclass(frozen=True, slots=True)
class SimResult:
    """Makespan, per-GPU busy fraction of each lane, and a timeline of (vertex, gpu, lane, start, end)."""

    makespan: float
    busy: list[dict[str, float]]  # per GPU: lane -> busy time / makespan
    timeline: list[tuple[int, int, str, float, float]]
    profile: str = ""
    stats: dict = field(default_factory=dict)
    stream_of: dict[int, int] = field(default_factory=dict)  # vertex -> the runtime's stream it ran on

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


def simulate(
    mg: MemGraph,
    tg: TaskGraph,
    cost: Profile | UnitCost | Replay,
    streams: int | None = None,
    *,
    ahead: int | None = None,
    host: Host | None = None,
) -> SimResult:
    """Runs `mg` (planned from `tg`) in simulated time; GraphError if it deadlocks (a cycle).

    Args:
        mg: the MemGraph; its ids give the priority (lowest first).
        tg: the TaskGraph it was planned from (kernels' ops and shapes).
        cost: a device profile, the unit cost model or a replayed trace (`replay.Replay`).
        streams: compute streams per GPU (WorkerConfig.streams); defaults to the cost model's.
        ahead: kernels launched ahead per stream (WorkerConfig.ahead); defaults to the cost model's.
        host: the host's costs (completion time, the reporter's lag); default none.
    """
    S = streams if streams is not None else cost.streams
    if S < 1:
        raise ValueError(f"streams must be >= 1, got {S}")
    A = ahead if ahead is not None else cost.ahead
    dur = {v.id: _duration(v, tg, cost) for v in mg.vertices}
    eng = SimEngine(mg, dur, S, A, host or Host(), cost.overlap)
    span = eng.run()
    lane = {v.id: eng.workers[v.gpu].engine[span[v.id][0]].value for v in mg.vertices}
    makespan = max((e for _, _, e in span.values()), default=0.0)
    busy = [[0.0] * len(LANES) for _ in range(mg.gpus)]
    for v in mg.vertices:
        busy[v.gpu][LANES.index(lane[v.id])] += dur[v.id]
    frac = [
        {ln: (busy[g][i] / makespan if makespan > 0 else 0.0) for i, ln in enumerate(LANES)}
        for g in range(mg.gpus)
    ]
    timeline = [(v.id, v.gpu, lane[v.id], span[v.id][1], span[v.id][2]) for v in mg.vertices]
    timeline.sort(key=lambda e: (e[3], e[0]))
    kinds: dict[str, int] = {k.value: 0 for k in MKind}
    for v in mg.vertices:
        kinds[v.kind.value] += 1
    stats = {"streams": S, "ahead": A, "by_kind": kinds, "work": sum(dur.values()), **eng.statistics()}
    return SimResult(makespan, frac, timeline, cost.name, stats, {v: sp[0] for v, sp in span.items()})


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
