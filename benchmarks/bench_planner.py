"""Planning time of build_memgraph on random DAGs over 4 GPUs at a capacity that forces offloads.

Usage: PYTHONPATH=. python benchmarks/bench_planner.py [--sizes 10000 20000 50000 100000]
       [--gpus 4] [--capacity-mib 2 | --fraction 0.05] [--seed 0]
Goal: 100k vertices planned in <= 10 s.
"""

from __future__ import annotations

import argparse
import time

from disco_ray.graph.memgraph import MKind
from planner import build_memgraph, min_capacity, tight_capacity
from workloads.random_dag import random_dag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 20_000, 50_000, 100_000])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument(
        "--capacity-mib",
        type=float,
        default=2.0,
        help="arena per GPU (raised to what the largest vertex needs): ~32 of the largest tensors",
    )
    ap.add_argument(
        "--fraction",
        type=float,
        default=None,
        help="instead: this share of each GPU's tensor bytes (grows with the graph)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        f"{'vertices':>9} {'gen s':>6} {'plan s':>7} {'memgraph':>9} {'offloads':>9} {'reloads':>8} "
        f"{'mem edges':>10}  capacity per GPU (MiB)"
    )
    for n in args.sizes:
        t0 = time.perf_counter()
        tg = random_dag(n, args.gpus, args.seed)
        if args.fraction is not None:
            cap = tight_capacity(tg, args.fraction)
        else:
            cap = [max(m, int(args.capacity_mib * 2**20)) for m in min_capacity(tg)]
        t1 = time.perf_counter()
        mg = build_memgraph(tg, cap)
        t2 = time.perf_counter()
        off = sum(1 for v in mg.vertices if v.kind is MKind.OFFLOAD)
        rel = sum(1 for v in mg.vertices if v.kind is MKind.RELOAD)
        mem = sum(1 for e in mg.edges if e[2] == "mem")
        caps = " ".join(f"{c / 2**20:.1f}" for c in cap)
        print(
            f"{n:>9} {t1 - t0:>6.2f} {t2 - t1:>7.2f} {len(mg):>9} {off:>9} {rel:>8} {mem:>10}  {caps}",
            flush=True,
        )


if __name__ == "__main__":
    main()
