"""Start-up cost of a run on the ray engine: what a sub-millisecond graph pays before and after it.

    PYTHONPATH=. python benchmarks/bench_startup.py [--repeat 3] [--json OUT.json]

Each case runs in a fresh process (so a cold start is cold), on examples/chain.json (13 vertices,
2 GPUs, planned for 48 KiB arenas), `--repeat` times; the median and range are printed.

- `cli local engine`: `disco-ray run --engine local`: no Ray at all (the floor: Python, torch, plan).
- `cli private Ray`: `disco-ray run` starting and stopping its own Ray (DISCO_RAY_ADDRESS=local).
- `cli running Ray`: `disco-ray run` joining a cluster left running with `ray start --head`.
- `python`: one process, `disco_ray.run` twice, then `disco_ray.shutdown()`, timed in phases:
  Ray (start or connect), the actors (a coordinator and a worker per GPU: a process each, which
  imports torch), the first run (loading the graph into the actors included), the second run (the
  shared pool is warm: same actors, a new graph loaded), and the shutdown.

The cluster for the "running Ray" cases is started once by this script on free ports with its own
temp dir (tests/ray_cluster.py: only its own processes are stopped afterwards), with token
authentication off as in the test suite. Figures are wall-clock seconds of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPH = ROOT / "examples" / "chain.json"

PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import ray
import disco_ray
from disco_ray.driver import pool as driver_pool
from disco_ray.driver.cluster import connect, running_cluster
from disco_ray.graph.formats import load_taskgraph
from disco_ray.graph.reference import random_inputs
tg = load_taskgraph(sys.argv[1]); inputs = random_inputs(tg)
t1 = time.perf_counter()
addr = running_cluster()
if addr:
    connect(addr)
else:
    ray.init(address="local", num_gpus=tg.gpus, include_dashboard=False, logging_level="WARNING")
t2 = time.perf_counter()
pool = driver_pool.shared_pool()
pool.acquire(tg.gpus)
ray.get([w.ping.remote() for w in [*pool.workers, pool.coord]])
t3 = time.perf_counter()
disco_ray.run(tg, inputs, capacity="48KiB", engine="ray")
t4 = time.perf_counter()
disco_ray.run(tg, inputs, capacity="48KiB", engine="ray")
t5 = time.perf_counter()
disco_ray.shutdown(); ray.shutdown()
t6 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "ray": t2 - t1, "actors": t3 - t2, "first run": t4 - t3,
                  "second run": t5 - t4, "shutdown": t6 - t5, "total": t6 - t0}))
"""


def _env(address: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "DISCO_RAY_ADDRESS": address}
    env.pop("RAY_ADDRESS", None)
    return env


def _cli(address: str, engine: str, out: str) -> float:
    args = [sys.executable, "-m", "disco_ray", "run", str(GRAPH), "--capacity", "48KiB", "--out", out]
    t = time.perf_counter()
    r = subprocess.run([*args, "--engine", engine], env=_env(address), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"disco-ray run failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t


def _phases(address: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PHASES, str(GRAPH)], env=_env(address), capture_output=True, text=True
    )
    if r.returncode:
        raise RuntimeError(f"phases failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", metavar="OUT.json", help="also write every figure here")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.ray_cluster import LocalCluster

    out = tempfile.mkdtemp(prefix="bench_startup") + "/out.npz"
    res: dict[str, list] = {"cli local engine": [], "cli private Ray": [], "cli running Ray": []}
    res["python, private Ray"] = []
    res["python, running Ray"] = []
    cluster = LocalCluster().start_head(num_cpus=os.cpu_count() or 2, num_gpus=2)
    try:
        for _ in range(args.repeat):
            res["cli local engine"].append(_cli("local", "local", out))
            res["cli private Ray"].append(_cli("local", "ray", out))
            res["cli running Ray"].append(_cli(cluster.address, "ray", out))
            res["python, private Ray"].append(_phases("local"))
            res["python, running Ray"].append(_phases(cluster.address))
    finally:
        cluster.stop()
    print(f"start-up of a 13-vertex graph on 2 GPUs (cpu backend), {args.repeat} runs each, median (range)")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    for name in ("cli local engine", "cli private Ray", "cli running Ray"):
        print(f"  {name:28s} {_fmt(res[name])}  (whole command)")
    for name in ("python, private Ray", "python, running Ray"):
        print(f"  {name}:")
        for phase in ("imports", "ray", "actors", "first run", "second run", "shutdown", "total"):
            print(f"    {phase:26s} {_fmt([r[phase] for r in res[name]])}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
