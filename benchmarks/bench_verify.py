"""Time of the MemGraph verifier (and one symbolic execution) on a planned random DAG.

Usage: PYTHONPATH=. python benchmarks/bench_verify.py [--n 20000] [--gpus 4] [--fraction 0.05] [--seed 0]
Goal: a 20k-vertex MemGraph verified in <= 30 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import random
import time

from planner import build_memgraph, tight_capacity
from planner.symbolic import execute
from planner.verify import verify
from workloads.random_dag import random_dag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tg = random_dag(args.n, args.gpus, args.seed)
    t0 = time.perf_counter()
    mg = build_memgraph(tg, tight_capacity(tg, args.fraction))
    t1 = time.perf_counter()
    msgs = verify(tg, mg)
    t2 = time.perf_counter()
    execute(tg, mg, random.Random(args.seed), in_flight=4)
    t3 = time.perf_counter()
    kinds = mg.statistics()["by_kind"]
    print(
        f"TaskGraph {len(tg)} vertices on {args.gpus} GPUs -> MemGraph {len(mg)} vertices, {len(mg.edges)} edges, "
        f"{kinds['offload']} offloads, {kinds['reload']} reloads (planned in {t1 - t0:.2f} s)"
    )
    print(f"verify: {t2 - t1:.2f} s, {len(msgs)} violations{': ' + msgs[0] if msgs else ''}")
    print(f"symbolic execution, one order (4 in flight): {t3 - t2:.2f} s")


if __name__ == "__main__":
    main()
