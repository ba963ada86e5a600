"""Scheduler overhead: vertices per second of 20k-vertex graphs of no-op kernels, local vs ray engine.

    PYTHONPATH=. python benchmarks/bench_scheduler.py [--n 20000] [--gpus 2] [--engines local,ray]

Graphs (every vertex is the `noop` test op of actors/testops.py: it does nothing, so the time
is the runtime's own cost):
- chain: n vertices on GPU 0, each reading the previous one (no round trip should be needed);
- wide: layers of `width` vertices spread over the GPUs; each reads a vertex of the previous
  layer on its own GPU and also depends (a memory edge) on one on the next GPU, so every vertex
  has a cross-worker edge through the coordinator.
MemGraphs come from planner.build_memgraph (planning is not timed).
Prints, per engine and graph, the best of --repeat runs: vertices/s and us per vertex.
"""

from __future__ import annotations

import argparse
import sys
import time

import actors.testops  # noqa: F401  (registers noop)
from disco_ray.driver.program import Program
from disco_ray.graph.memgraph import MemGraph, MKind
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph


def noop_memgraph(tg: TaskGraph, extra_edges: list[tuple[str, str]] = ()) -> MemGraph:
    """planner.build_memgraph with room to spare, plus memory edges between values `extra_edges`."""
    mg = build_memgraph(tg, 1 << 24)
    vid = {v.value: v.id for v in mg.vertices if v.kind is MKind.KERNEL}
    mg.edges = [*mg.edges, *((vid[a], vid[b], "mem") for a, b in extra_edges)]
    return mg


def chain(n: int, gpus: int) -> tuple[TaskGraph, MemGraph]:
    g = TaskGraph(gpus=gpus)
    prev = g.kernel("noop", gpu=0, id="c0", shape=[4])
    for i in range(1, n):
        prev = g.kernel("noop", prev, gpu=0, id=f"c{i}", shape=[4])
    g.output(prev)
    return g, noop_memgraph(g)


def wide(n: int, gpus: int, width: int = 200) -> tuple[TaskGraph, MemGraph]:
    g = TaskGraph(gpus=gpus)
    layers = n // width
    extra = []
    for layer in range(layers):
        for j in range(width):
            gpu = j % gpus
            ins = [f"w{layer - 1}_{j}"] if layer else []
            g.kernel("noop", *ins, gpu=gpu, id=f"w{layer}_{j}", shape=[4])
            if layer and gpus > 1:
                extra.append((f"w{layer - 1}_{(j + 1) % width}", f"w{layer}_{j}"))  # on the next GPU
    g.output(*[f"w{layers - 1}_{j}" for j in range(width)])
    return g, noop_memgraph(g, extra)


def bench(
    engine: str,
    name: str,
    tg: TaskGraph,
    mg: MemGraph,
    repeat: int,
    streams: int,
    flush_s: float,
    ahead: int | None,
) -> dict:
    with Program(
        tg, mg, engine=engine, streams=streams, ahead=ahead, flush_s=flush_s, op_modules=["actors.testops"]
    ) as prog:
        prog.run({})  # warm up: actors started, graph loaded
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            prog.run({})
            best = min(best, time.perf_counter() - t)
        stats = prog.statistics()
    sched = stats["engine"]["scheduler"]
    reports = sum(w["reports"] for w in stats["engine"]["workers"])
    return {
        "engine": engine,
        "graph": name,
        "vertices": len(mg),
        "seconds": best,
        "vertices_per_s": len(mg) / best,
        "us_per_vertex": best / len(mg) * 1e6,
        "cross_edges": sched["cross_worker_edges"],
        "dispatch_msgs": sched["dispatch_messages"],
        "report_batches": reports,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--streams", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ahead", type=int, help="kernels launched ahead per stream (default: the backend's)")
    ap.add_argument("--flush-ms", type=float, default=1.0, help="longest a busy worker holds back reports")
    ap.add_argument("--width", type=int, default=1000, help="vertices per layer of the wide graph")
    ap.add_argument("--engines", default="local,ray")
    ap.add_argument("--graphs", default="chain,wide")
    args = ap.parse_args(argv)
    graphs = {"chain": chain, "wide": lambda n, gpus: wide(n, gpus, args.width)}
    rows = []
    ray_started = False
    for engine in args.engines.split(","):
        if engine == "ray":
            import ray

            if not ray.is_initialized():
                ray.init(
                    address="local", num_gpus=args.gpus, include_dashboard=False, logging_level="WARNING"
                )
                ray_started = True
        for name in args.graphs.split(","):
            tg, mg = graphs[name](args.n, args.gpus)
            r = bench(engine, name, tg, mg, args.repeat, args.streams, args.flush_ms / 1e3, args.ahead)
            rows.append(r)
            print(
                f"{engine:6s} {name:6s} ahead {args.ahead} {r['vertices']:6d} vertices  {r['seconds'] * 1e3:8.1f} ms  "
                f"{r['vertices_per_s']:9.0f} vertices/s  {r['us_per_vertex']:6.1f} us/vertex  "
                f"(cross-worker edges {r['cross_edges']}, dispatch msgs {r['dispatch_msgs']}, "
                f"report batches {r['report_batches']})",
                flush=True,
            )
    if ray_started:
        import ray

        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
