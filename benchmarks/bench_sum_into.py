"""Sum-into accumulation (TURNIP appendix A) against one n-ary add and a fixed chain of adds.

    .venv/bin/python benchmarks/bench_sum_into.py [--partials 64] [--layers 2] [--seq 256] [--7b-layers 1]

Two graphs, each built three ways (`accumulate` planned as sum-into kernels, one n-ary `add`, a
chain of two-operand adds), planned by BUILDMEMGRAPH in the builder's order (as `LoraTrainer`
plans) and simulated under the h100 profile (disco_ray.bench.simulate):

- `partials`: n products of two [256, 256] float32 inputs summed into one (a weight gradient
  summed over n tiles, alone);
- `lora`: one LoRA training step (rank 16 on all seven linear layers, AdamW) of a small
  LLaMA-shaped model on 2 GPUs, batch 2 x seq tokens in tiles of 64: every adapter gradient is a
  sum of one partial per tile and sequence;
- `lora 7b` (with --7b-layers N): the same with LLaMA-7B's shapes, N of its 32 layers, on 8 GPUs,
  batch 8 x 1024 tokens in tiles of 512, rank 16 on q, k, v, gate, up, down (the papers' setting,
  two tiles per sequence), simulated under the a100 profile.

Columns: `live peak`, the most bytes the in-memory plan holds at once on a GPU in its serial
order (a range from its first writer to its last reader); `no-offload capacity`, the least arena
per GPU (bisection, 1% steps) at which the plan moves nothing; `least capacity`, the least at which
it plans at all; then, at one tight capacity for all three (half the n-ary add's no-offload
capacity), the bytes reloaded and the simulated makespan, and the makespan in memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disco_ray.bench.profiles import h100  # noqa: E402
from disco_ray.bench.simulate import simulate  # noqa: E402
from disco_ray.graph.errors import CapacityError, PlanError  # noqa: E402
from disco_ray.graph.memgraph import HOST, MemGraph  # noqa: E402
from disco_ray.graph.taskgraph import TaskGraph  # noqa: E402
from planner import build_memgraph, min_capacity, roomy_capacity  # noqa: E402

SUMS = ("sum_into", "add", "chain")
MiB = 1 << 20


def partials_graph(n: int, grad_sum: str) -> TaskGraph:
    g = TaskGraph(1)
    parts = [
        g.matmul(g.input(f"a{k}", (256, 256)), g.input(f"b{k}", (256, 256)), id=f"p{k}") for k in range(n)
    ]
    if grad_sum == "sum_into":
        s = g.kernel("accumulate", *parts, id="sum")
    elif grad_sum == "add":
        s = g.add(*parts, id="sum")
    else:
        s = parts[0]
        for k, p in enumerate(parts[1:]):
            s = g.add(s, p, id=f"sum{k}")
    g.output(g.scale(s, 0.5, id="out"))
    return g


def lora_graph(layers: int, seq: int, grad_sum: str, big: bool = False) -> TaskGraph:
    from workloads.llm.checkpoint import Checkpoint
    from workloads.llm.families import parse_config
    from workloads.llm.train import TARGETS, LoraSpec, OptimSpec, train_graph

    dims = (32000, 4096, 11008, 32, 32) if big else (4096, 512, 1376, 8, 4)
    cfg = parse_config(
        {
            "model_type": "llama",
            "vocab_size": dims[0],
            "hidden_size": dims[1],
            "intermediate_size": dims[2],
            "num_hidden_layers": layers,
            "num_attention_heads": dims[3],
            "num_key_value_heads": dims[4],
            "rms_norm_eps": 1e-6,
        },
        "llama-7b" if big else "bench-lora",
    )
    ck = Checkpoint.virtual(cfg, "float32")
    if big:
        spec = LoraSpec(16, 32.0, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))
        return train_graph(ck, 8, 8, 1024, 512, spec, OptimSpec(lr=1e-4), "float32", grad_sum).taskgraph
    spec = LoraSpec(16, 32.0, tuple(TARGETS))
    return train_graph(ck, 2, 2, seq, 64, spec, OptimSpec(lr=1e-4), "float32", grad_sum).taskgraph


def plan(tg: TaskGraph, cap) -> MemGraph | None:
    try:
        return build_memgraph(tg, cap, order=[v.id for v in tg])
    except (CapacityError, PlanError):
        return None


def live_peak(mg: MemGraph) -> int:
    """The most GPU bytes live at once in the plan's serial order, over its GPUs."""
    pos = {v.id: p for p, v in enumerate(mg.vertices)}
    start: dict[int, int] = {}  # writer (a group: its last member) -> first write
    first: dict[str, int] = {}
    for p, v in enumerate(mg.vertices):
        if v.acc is not None:
            first.setdefault(v.value, p)
    end: dict[int, int] = {}
    for p, v in enumerate(mg.vertices):
        if v.out.device != HOST:
            start[v.id] = first.get(v.value, p) if v.acc is not None else p
            end[v.id] = p
        for r in v.ins:
            if r.src is not None and r.src in end:
                end[r.src] = max(end[r.src], p)
    for vid in mg.outputs.values():
        end[vid] = len(mg)
    peak = 0
    for g in range(mg.gpus):
        delta = [0] * (len(mg) + 2)
        for vid, s in start.items():
            v = mg.vertices[pos[vid]]
            if v.out.device == g and (v.acc is None or end[vid] > pos[vid]):
                delta[s] += v.out.nbytes
                delta[end[vid] + 1] -= v.out.nbytes
        live = 0
        for d in delta:
            live += d
            peak = max(peak, live)
    return peak


def least(tg: TaskGraph, lo: int, hi: int, ok) -> int:
    """The least capacity in [lo, hi] (to 1%) whose plan satisfies `ok`."""
    while hi - lo > max(hi // 100, 4096):
        mid = (lo + hi) // 2
        mg = plan(tg, mid)
        if mg is not None and ok(mg):
            hi = mid
        else:
            lo = mid
    return hi


def rows(name: str, make, profile=h100) -> list[str]:
    graphs = {s: make(s) for s in SUMS}
    out = []
    free_cap = {}
    for s, tg in graphs.items():
        hi = max(roomy_capacity(tg)) + MiB
        free_cap[s] = least(tg, 0, hi, lambda mg: mg.stats["bytes_reloaded"] == 0)
    tight = free_cap["add"] // 2
    for s, tg in graphs.items():
        roomy = plan(tg, max(roomy_capacity(tg)) + MiB)
        assert roomy is not None
        mem = simulate(roomy, tg, profile).makespan
        floor = least(tg, 0, free_cap[s], lambda mg: True)
        floor = max(floor, max(min_capacity(tg)) if s != "sum_into" else 0)
        mg = plan(tg, tight)
        if mg is None:
            at = "does not plan | -"
        else:
            t = simulate(mg, tg, profile).makespan
            at = f"{mg.stats['bytes_reloaded'] / MiB:.1f} | {t * 1e3:.2f} ms ({t / mem:.2f}x)"
        out.append(
            f"| {name} | {s} | {len(tg)} | {live_peak(roomy) / MiB:.1f} | {free_cap[s] / MiB:.1f} | "
            f"{floor / MiB:.1f} | {at} | {mem * 1e3:.2f} ms |"
        )
    out.append(f"<!-- {name}: tight capacity {tight / MiB:.1f} MiB per GPU -->")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partials", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--7b-layers", dest="big", type=int, default=0, help="0: skip the 7B-shaped graph")
    args = ap.parse_args(argv)
    print(
        "| graph | grad sum | vertices | live peak MiB | no-offload capacity MiB | least capacity MiB | "
        "reloaded MiB at half add's no-offload | makespan there | makespan in memory |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for line in rows(f"partials n={args.partials}", lambda s: partials_graph(args.partials, s)):
        print(line, flush=True)
    for line in rows(
        f"lora layers={args.layers} seq={args.seq}", lambda s: lora_graph(args.layers, args.seq, s)
    ):
        print(line, flush=True)
    if args.big:
        from disco_ray.bench.profiles import a100

        for line in rows(f"lora 7b layers={args.big}", lambda s: lora_graph(args.big, 0, s, True), a100):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
