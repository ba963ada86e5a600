"""Peer-copy bandwidth between two cuda workers, through the path the runtime opened for them.

    python benchmarks/bench_peer_copy.py [--sizes 1MiB,64MiB,512MiB] [--repeat 5] [--share]

Two GpuWorker actors on the cuda backend (on two GPUs when Ray has two, else sharing one: each
asks for half of it, `--share` forces that) load a graph that moves one fp16 tensor of each size
from GPU 0 to GPU 1 and one back, each transfer followed by a small kernel that reads it.
Printed:
- the path the pair opened ("ipc": one GPU; "p2p": two GPUs with peer access, read over NVLink
  or PCIe; "nccl"; "ray": the object store), as the run summary reports it;
- per size and direction: the bandwidth of the run's own transfer vertices (bytes / the
  transfer's GPU interval from the trace, best of `repeat` runs after one warm-up);
- per size: the link probe of `disco_ray.driver.cluster.measure_links` (one copy timed in the
  receiving worker; a one-sided copy exists only for ipc and p2p, otherwise it times a pull
  through the object store and says so).
Needs CUDA and Ray (see ../shared/GPU.md on the lent machine).
"""

from __future__ import annotations

import argparse
import sys

import torch

from disco_ray.driver.cluster import measure_links
from disco_ray.driver.placement import PlacementConfig
from disco_ray.driver.pool import RayPool
from disco_ray.driver.program import Program
from disco_ray.graph.sizes import parse_size
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph


def peer_graph(nbytes: int) -> TaskGraph:
    """X (GPU 0) -> GPU 1 -> scaled there -> back to GPU 0 -> scaled: two transfers of `nbytes`."""
    n = nbytes // 2
    g = TaskGraph(gpus=2)
    x = g.input("X", (n,), "float16", gpu=0)
    there = g.scale(g.transfer(x, gpu=1, id="to1"), 0.5, id="s1", gpu=1)
    back = g.scale(g.transfer(there, gpu=0, id="to0"), 2.0, id="s0", gpu=0)
    g.output(back)
    return g


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MiB,64MiB,512MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--share", action="store_true", help="both workers on one GPU (half each)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_peer_copy: needs CUDA", file=sys.stderr)
        return 2
    import ray

    ray.init(address="local", num_gpus=torch.cuda.device_count(), include_dashboard=False)
    share = args.share or torch.cuda.device_count() < 2
    pool = RayPool(placement=PlacementConfig(gpus_per_worker=0.5 if share else 1.0))
    print(f"devices: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}; workers "
          f"{'share one GPU' if share else 'on two GPUs'}")  # fmt: skip
    print("size      path  0->1 GB/s  1->0 GB/s  probe 0->1 GB/s  probe via")
    try:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            tg = peer_graph(size)
            mg = build_memgraph(tg, 2 * size + (1 << 20))
            inputs = {"X": torch.randn(size // 2, dtype=torch.float16)}
            with Program(tg, mg, engine="ray", backend="cuda", pool=pool, streams=2) as prog:
                best: dict[str, float] = {}
                for r in range(args.repeat + 1):
                    out = prog.run(inputs, timeout=300)
                    if r == 0:
                        continue  # warm-up
                    for recs in prog.last_records or []:
                        for vid, _, t0, t1 in recs:
                            v = mg.vertex(vid)
                            if v.kind.value == "transfer":
                                gbps = v.out.nbytes / max(t1 - t0, 1)
                                best[v.value] = max(best.get(v.value, 0.0), gbps)
                torch.testing.assert_close(out["s0"], inputs["X"], rtol=1e-3, atol=1e-3)
                path = (prog.last_summary or {}).get("transports", {}).get("0-1", "?")
                links = measure_links(prog, backend="cuda", nbytes=size, repeats=args.repeat, pairs=[(0, 1)])
                link = links["links"][0]
            print(
                f"{size / 2**20:6.0f}MiB {path:>5s}  {best.get('to1', 0):9.1f}  {best.get('to0', 0):9.1f}  "
                f"{link['gbps']:15.1f}  {link['via']}",
                flush=True,
            )
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
