"""Planner quality (issue 12): every figure, printed. Simulated times use the h100 profile.

Sections (`--only NAME,...`; all by default):
  belady   reloads vs Belady's MIN on one tensor size (must be equal), gap to the lower bound on mixed sizes
  order    the default (schedule) order vs the builder's list order and depth-first, per workload
  fit      free-range choice oldest / best / fewest: simulated makespan and memory edges
  goal     at capacities with no offloads: dynamic makespan / in-memory makespan (goal: <= 1.05)
  edges    memory edges built, dropped as implied, kept, and the exact count still implied
  today    the planner of another checkout (--baseline DIR, e.g. main) on the same graphs
  scale    the 65B prefill graph (80 layers, 8 GPUs, seq 16K): plan and verify time, peak memory

Capacities are fractions of each GPU's tensor bytes (`planner.roomy_capacity`), floored at what
the largest vertex needs. "in-memory" is the best of the unlimited-capacity plans in the builder's
and the planner's order. Timings are wall-clock best of --repeat on whatever machine runs this.

    PYTHONPATH=. python benchmarks/bench_quality.py [--only order,goal] [--baseline /tmp/main]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

import workloads
from disco_ray.bench import modes, profiles
from disco_ray.bench.simulate import simulate
from disco_ray.graph import formats
from disco_ray.graph.memgraph import MemGraph
from planner import build_memgraph, default_order, min_capacity, roomy_capacity
from planner.bounds import min_reload_bytes
from planner.order import depth_first_order, random_order
from planner.reach import Reach
from workloads.random_dag import random_dag

PROFILE = profiles.h100
FRACTIONS = (0.5, 0.35, 0.25, 0.2, 0.15, 0.1, 0.05)
WORKLOADS = {
    "llama_prefill": ("llama_prefill", dict(preset="65b", layers=2, gpus=8, seq=4096)),
    "matmul_chain": ("matmul_chain", dict(n=16, gpus=1, tokens=8192, hidden=8192, dtype="float16")),
    "matmul_chain_tp4": ("matmul_chain", dict(n=16, gpus=4, tokens=8192, hidden=8192, dtype="float16")),
    "random_dag": ("random_dag", dict(n=3000, gpus=4, seed=0)),
}


def workload(name: str):
    kind, kw = WORKLOADS[name]
    return workloads.build(kind, **kw, materialize=False)


def caps(tg, f: float) -> list[int]:
    return [max(m, int(r * f) // 256 * 256) for m, r in zip(min_capacity(tg), roomy_capacity(tg))]


def makespan(mg: MemGraph, tg) -> float:
    return simulate(mg, tg, PROFILE).makespan


def in_memory(w) -> float:
    return min(makespan(modes.in_memory(w.taskgraph, order=o), w.taskgraph) for o in (None, w.order()))


def measured(names):
    """(name, workload, TaskGraph, in-memory makespan) of each workload named."""
    for name in names:
        w = workload(name)
        yield name, w, w.taskgraph, in_memory(w)


def gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


# ---- belady ---------------------------------------------------------------------------------------
def section_belady(args) -> None:
    print("\n== reloads vs Belady's MIN (same serial order) ==")
    slot = 32 * 32 * 4
    equal = cases = 0
    worst = 1.0
    for seed in range(args.cases):
        rng = random.Random(seed)
        tg = random_dag(rng.randint(40, 200), rng.randint(1, 4), seed, sizes=(32,))
        least = max(min_capacity(tg)) // slot
        for order in (None, depth_first_order(tg), random_order(tg, seed)):
            cap = rng.randint(max(4, least), max(4, least) + 6) * slot
            got = build_memgraph(tg, cap, order=order).stats["bytes_reloaded"]
            want = sum(min_reload_bytes(tg, cap, order or default_order(tg, cap)))
            cases += 1
            equal += got == want
            worst = max(worst, got / want if want else 1.0)
    print(f"one tensor size: {cases} cases (1-4 GPUs, 4-10+ slots; default, depth-first, random orders):")
    print(f"  reloads equal to MIN in {equal} of {cases}; worst planner/MIN {worst:.3f}")
    print("mixed sizes (random_dag sizes 16..128, capacity fraction): reload bytes vs the lower bound")
    print(f"{'graph':>24} {'frac':>5} {'planner MiB':>12} {'bound MiB':>10} {'gap':>7}")
    rows = [(f"random_dag(800, 3, {s})", random_dag(800, 3, s)) for s in range(3)]
    rows.append(("llama_prefill 65b/2/4K", workload("llama_prefill").taskgraph))
    for name, tg in rows:
        for f in (0.1, 0.05, 0.02):
            cap = caps(tg, f)
            got = build_memgraph(tg, cap).stats["bytes_reloaded"]
            bound = sum(min_reload_bytes(tg, cap, default_order(tg, cap)))
            gap = f"{(got - bound) / bound * 100:6.1f}%" if bound else "   n/a"
            print(f"{name:>24} {f:5.2f} {got / 2**20:12.2f} {bound / 2**20:10.2f} {gap:>7}")


# ---- order ----------------------------------------------------------------------------------------
def section_order(args) -> None:
    print("\n== serial order: reload GB / simulated makespan x in-memory ==")
    for name, w, tg, mem in measured(WORKLOADS):
        orders = {"default": None, "builder list": w.order(), "depth-first": depth_first_order(tg)}
        print(f"{name} ({len(tg)} vertices), in-memory {mem * 1e3:.2f} ms")
        print(f"{'frac':>6} " + " ".join(f"{o:>22}" for o in orders))
        for f in FRACTIONS:
            cells = []
            for o in orders.values():
                mg = build_memgraph(tg, caps(tg, f), order=o)
                cells.append(f"{gb(mg.stats['bytes_reloaded'])} / {makespan(mg, tg) / mem:5.2f}x")
            print(f"{f:6.2f} " + " ".join(f"{c:>22}" for c in cells))
    print("random graphs (random_dag 2000 vertices, 4 GPUs, seeds 1-5), geometric mean over seeds:")
    for f in (0.2, 0.1, 0.05):
        acc: dict[str, list[float]] = {"default": [], "builder list": [], "depth-first": []}
        rel: dict[str, float] = dict.fromkeys(acc, 0.0)
        for seed in range(1, 6):
            tg = random_dag(2000, 4, seed)
            orders = {
                "default": None,
                "builder list": list(tg.vertices),
                "depth-first": depth_first_order(tg),
            }
            for o, order in orders.items():
                mg = build_memgraph(tg, caps(tg, f), order=order)
                acc[o].append(makespan(mg, tg))
                rel[o] += mg.stats["bytes_reloaded"]
        base = np.exp(np.mean(np.log(acc["default"])))
        print(
            f"  frac {f:4.2f}: "
            + ", ".join(
                f"{o} makespan {np.exp(np.mean(np.log(v))) / base:.3f}x reload {gb(rel[o])} GB"
                for o, v in acc.items()
            )
        )


# ---- fit ------------------------------------------------------------------------------------------
def section_fit(args) -> None:
    print("\n== free-range choice (default order): makespan x in-memory (memory edges kept) ==")
    for name, _, tg, mem in measured(("llama_prefill", "matmul_chain", "matmul_chain_tp4")):
        print(f"{name}: {'frac':>5} " + " ".join(f"{fit:>20}" for fit in ("oldest", "best", "fewest")))
        for f in FRACTIONS:
            cells = []
            for fit in ("oldest", "best", "fewest"):
                mg = build_memgraph(tg, caps(tg, f), fit=fit)
                cells.append(f"{makespan(mg, tg) / mem:5.3f}x ({mg.statistics()['mem_edges']})")
            print(f"{'':{len(name) + 1}} {f:5.2f} " + " ".join(f"{c:>20}" for c in cells))


# ---- goal -----------------------------------------------------------------------------------------
def section_goal(args) -> None:
    print("\n== capacities with no offloads: dynamic / in-memory simulated makespan (goal <= 1.05) ==")
    for name, _, tg, mem in measured(("llama_prefill", "matmul_chain", "matmul_chain_tp4")):
        rows = []
        for f in np.round(np.arange(0.6, 0.0, -0.025), 3):
            mg = build_memgraph(tg, caps(tg, float(f)))
            if mg.stats["bytes_offloaded"] or mg.stats["bytes_reloaded"]:
                break
            rows.append((float(f), makespan(mg, tg) / mem))
            if caps(tg, float(f)) == min_capacity(tg):
                break  # the least capacity any plan works with: smaller fractions are the same
        worst = max(r for _, r in rows)
        within = min((f for f, _ in rows if all(r <= 1.05 for g, r in rows if g >= f)), default=None)
        print(
            f"{name}: in-memory {mem * 1e3:.2f} ms; no offload down to {rows[-1][0]:.3f} of the tensor bytes; "
            f"ratio there {rows[-1][1]:.3f}, worst {worst:.3f}; within 5% at every capacity from "
            + (f"{within:.3f} up" if within is not None else "none")
        )
        print("  " + ", ".join(f"{f:.3f}: {r:.3f}" for f, r in rows))


# ---- edges ----------------------------------------------------------------------------------------
def still_implied(mg: MemGraph) -> int:
    """Exact count of memory edges some other path implies (u an ancestor of another predecessor of w)."""
    n = len(mg)
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, w, _ in mg.edges:
        preds[w].append(u)
    reach = Reach(preds, list(range(n)))  # planner ids are a topological order
    qu, qp, qe = [], [], []
    for k, (u, w, kind) in enumerate(mg.edges):
        if kind == "mem":
            for p in preds[w]:
                if p != u:
                    qu.append(u)
                    qp.append(p)
                    qe.append(k)
    if not qu:
        return 0
    ok = reach.ancestors(np.array(qu), np.array(qp))
    return len(np.unique(np.array(qe)[ok]))


def section_edges(args) -> None:
    print("\n== memory edges: built (after duplicates), dropped as implied, kept, still implied (exact) ==")
    print(
        f"{'graph':>18} {'frac':>5} {'data':>7} {'built':>7} {'dropped':>8} {'kept':>7} {'implied':>8} {'x-GPU kept':>10}"
    )
    for name in WORKLOADS:
        w = workload(name)
        tg = w.taskgraph
        for f in (0.35, 0.1):
            mg = build_memgraph(tg, caps(tg, f))
            st = mg.statistics()
            cross = sum(1 for u, v, k in mg.edges if k == "mem" and mg.vertices[u].gpu != mg.vertices[v].gpu)
            print(
                f"{name:>18} {f:5.2f} {st['data_edges']:7d} {st['mem_edges_built']:7d} {st['implied_mem_edges']:8d} "
                f"{st['mem_edges']:7d} {still_implied(mg):8d} {cross:10d}"
            )


# ---- today's planner ------------------------------------------------------------------------------
_BASELINE = r"""
import json, sys, time
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", ""))]
sys.path.insert(0, sys.argv[1])
from disco_ray.graph import formats
from planner import build_memgraph
tg = formats.load_taskgraph(sys.argv[2])
order = json.load(open(sys.argv[5])) if sys.argv[5] != "-" else None
t = time.perf_counter()
mg = build_memgraph(tg, json.loads(sys.argv[3]), order=order)
mg.stats["wall"] = time.perf_counter() - t
formats.save(mg, sys.argv[4])
"""


def baseline_plan(base: str, tg, cap: list[int], order: list[str] | None, tmp: str) -> MemGraph:
    """Plans `tg` with the planner of checkout `base` in a subprocess; returns its MemGraph."""
    tgf, mgf, of = (os.path.join(tmp, x) for x in ("tg.msgpack", "mg.msgpack", "order.json"))
    formats.save(tg, tgf)
    if order is not None:
        with open(of, "w") as fh:
            json.dump(order, fh)
    cmd = [sys.executable, "-c", _BASELINE, base, tgf, json.dumps(cap), mgf, of if order is not None else "-"]
    subprocess.run(cmd, check=True)
    return formats.load_memgraph(mgf)


def section_today(args) -> None:
    if not args.baseline:
        print("\n== today's planner: skipped (give --baseline DIR, a checkout of the old code) ==")
        return
    print(f"\n== this planner vs the planner in {args.baseline} (its default order, and the builder's) ==")
    print(
        f"{'graph':>18} {'frac':>5} | {'reload GB':>9} {'x-mem':>6} {'mem edges':>9} | "
        f"{'old dflt GB':>11} {'x-mem':>6} {'mem edges':>9} | {'old list GB':>11} {'x-mem':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, w, tg, mem in measured(WORKLOADS):
            for f in FRACTIONS:
                cap = caps(tg, f)
                new = build_memgraph(tg, cap)
                old = baseline_plan(args.baseline, tg, cap, None, tmp)
                old_list = baseline_plan(args.baseline, tg, cap, w.order(), tmp)
                cells = []
                for mg in (new, old, old_list):
                    st = mg.statistics()
                    cells.append((gb(st.get("bytes_reloaded", 0)), makespan(mg, tg) / mem, st["mem_edges"]))
                print(
                    f"{name:>18} {f:5.2f} | {cells[0][0]:>9} {cells[0][1]:6.2f} {cells[0][2]:9d} | "
                    f"{cells[1][0]:>11} {cells[1][1]:6.2f} {cells[1][2]:9d} | {cells[2][0]:>11} {cells[2][1]:6.2f}"
                )
    print("uniform sizes, the old planner's reloads over Belady's MIN (same orders as the belady section):")
    excess = []
    with tempfile.TemporaryDirectory() as tmp:
        slot = 32 * 32 * 4
        for seed in range(min(args.cases, 30)):
            rng = random.Random(seed)
            tg = random_dag(rng.randint(40, 200), rng.randint(1, 4), seed, sizes=(32,))
            least = max(min_capacity(tg)) // slot
            cap = rng.randint(max(4, least), max(4, least) + 6) * slot
            order = depth_first_order(tg)
            old = baseline_plan(args.baseline, tg, [cap] * tg.gpus, order, tmp).statistics()
            want = sum(min_reload_bytes(tg, cap, order))
            if want:
                excess.append(old_reloads(old) / want - 1)
    print(
        f"  mean +{np.mean(excess) * 100:.1f}%, max +{np.max(excess) * 100:.1f}% over {len(excess)} cases (depth-first order)"
    )


def old_reloads(st: dict) -> int:
    return int(st.get("bytes_reloaded", 0))


# ---- scale ----------------------------------------------------------------------------------------
_SCALE = r"""
import gc, json, os, resource, sys, time
if len(sys.argv) > 6:  # the planner of another checkout
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", ""))]
    sys.path.insert(0, sys.argv[6])
import workloads
from planner import build_memgraph
from planner.verify import verify
what, cap, repeat, order, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
kw = {} if workers == "auto" else {"workers": int(workers)}
w = workloads.build("llama_prefill", preset="65b", layers=80, gpus=8, seq=16384, materialize=False)
tg = w.taskgraph
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {"vertices": len(tg), "rss_before_gib": before / 2**20}
best = None
for _ in range(repeat):
    t, c = time.perf_counter(), os.times()
    mg = build_memgraph(tg, cap, order=w.order() if order == "builder" else None, **kw)
    wall, e = time.perf_counter() - t, os.times()
    cpu = sum(e[:4]) - sum(c[:4])  # this process and its planner processes
    if best is None or wall < best[0]:
        best = (wall, cpu)
    if _ < repeat - 1:
        del mg
        gc.collect()
out["plan_wall_s"], out["plan_cpu_s"] = best
out["processes"] = mg.stats.get("planner_processes", 1)
out["plan_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
out["child_rss_gib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
st = mg.statistics()
out.update({k: st.get(k, 0) for k in ("vertices", "edges", "data_edges", "mem_edges", "mem_edges_built",
                                      "implied_mem_edges", "bytes_reloaded", "bytes_offloaded")})
out["memgraph_vertices"] = st["vertices"]
gpu = [v.gpu for v in mg.vertices]
out["cross_gpu_mem_edges"] = sum(1 for u, v, k in mg.edges if k == "mem" and gpu[u] != gpu[v])
if what == "plan" and order == "default" and workers == "auto":  # how many kept memory edges are still implied: a sample
    import random
    succ = [[] for _ in mg.vertices]
    for u, v, _ in mg.edges:
        succ[u].append(v)
    mem = [(u, v) for u, v, k in mg.edges if k == "mem"]
    hits = 0
    sample = random.Random(0).sample(mem, min(1000, len(mem)))
    for u, v in sample:  # a path u -> ... -> v other than the edge itself (ids are topological)
        seen, stack = {u}, [x for x in succ[u] if x < v]
        while stack:
            x = stack.pop()
            if x == v:
                hits += 1
                break
            if x not in seen:
                seen.add(x)
                stack += [y for y in succ[x] if y <= v and y not in seen]
    out["implied_sample"] = (hits, len(sample))
if what == "verify":
    t, c = time.perf_counter(), time.process_time()
    msgs = verify(tg, mg)
    out["verify_wall_s"], out["verify_cpu_s"] = time.perf_counter() - t, time.process_time() - c
    out["violations"] = len(msgs)
    out["verify_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(out))
"""


def _scale_run(*argv: str) -> dict | None:
    """Runs _SCALE in a fresh process (its own peak memory); its figures, or None (stderr printed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _SCALE, *argv], env=env, capture_output=True, text=True)
    if run.returncode:
        print(run.stderr)
        return None
    return json.loads(run.stdout)


def section_scale(args) -> None:
    cap = int(args.scale_gib * 2**30)
    print(
        f"\n== 65B prefill (80 layers, 8 GPUs, seq 16384, tile 512), capacity {args.scale_gib} GiB per GPU =="
    )

    def show(who: str, r: dict) -> None:
        forked = (
            f" + {r['child_rss_gib']:.2f} GiB in the largest forked planner process"
            if r.get("processes", 1) > 1
            else ""
        )
        print(
            f"{who}: plan {r['plan_wall_s']:.2f} s wall (best of {r['repeat']}), {r.get('processes', 1)} process(es), "
            f"{r['plan_cpu_s']:.2f} s CPU, peak RSS "
            f"{r['plan_rss_gib']:.2f} GiB{forked} (TaskGraph alone {r['rss_before_gib']:.2f}); MemGraph {r['memgraph_vertices']} "
            f"vertices, {r['edges']} edges ({r['data_edges']} data, {r['mem_edges']} mem of which "
            f"{r['cross_gpu_mem_edges']} cross-GPU; {r['mem_edges_built']} built, {r['implied_mem_edges']} dropped); "
            f"reloaded {gb(r['bytes_reloaded'])} GB"
        )

    for order, workers in (("default", "auto"), ("default", "1"), ("builder", "auto")):
        r = _scale_run("plan", str(cap), str(args.repeat), order, workers)
        if r is not None:
            how = "" if workers == "auto" else f", workers={workers}"
            show(f"this planner, {order} order{how}", {**r, "repeat": args.repeat})
            if "implied_sample" in r:
                hits, k = r["implied_sample"]
                p = hits / k
                half = 1.96 * (p * (1 - p) / k) ** 0.5
                print(
                    f"  memory edges kept but implied by another path: {p:.1%} +- {half:.1%} (sample of {k})"
                )
    v = _scale_run("verify", str(cap), "1", "default", "auto")
    if v is not None:
        print(
            f"verify (default-order plan): {v['verify_wall_s']:.2f} s wall, {v['verify_cpu_s']:.2f} s CPU, "
            f"{v['violations']} violations; peak RSS of the process (TaskGraph + plan + verify) {v['verify_rss_gib']:.2f} GiB"
        )
    for order in ("default", "builder") if args.baseline else ():
        b = _scale_run("plan", str(cap), "1", order, "auto", args.baseline)
        if b is not None:
            show(f"the planner in {args.baseline}, {order} order", {**b, "repeat": 1})


SECTIONS = {
    "belady": section_belady,
    "order": section_order,
    "fit": section_fit,
    "goal": section_goal,
    "edges": section_edges,
    "today": section_today,
    "scale": section_scale,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--baseline", metavar="DIR", help="a checkout of the planner to compare with (e.g. main)")
    ap.add_argument("--cases", type=int, default=60, help="random graphs in the belady section")
    ap.add_argument(
        "--repeat", type=int, default=3, help="timed planning runs of the 65B graph (best counts)"
    )
    ap.add_argument("--scale-gib", type=float, default=20.0, help="arena per GPU for the 65B graph")
    args = ap.parse_args()
    print(f"bench_quality: {os.cpu_count()} CPUs, profile {PROFILE.name}, python {sys.version.split()[0]}")
    for name in args.only.split(","):
        t = time.perf_counter()
        SECTIONS[name](args)
        print(f"[{name}: {time.perf_counter() - t:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
