"""Predicts the papers' LLaMA prefill settings with the simulator (no GPU needed).

Settings (TURNIP §8, DISCO §5): LLaMA-7B and -65B first-token inference of one prompt of 1K-16K
tokens, fp16, all weights starting in host memory, on 4 x P100 (16 GB) and 8 x A100 (40 GB). Each
setting is planned with the planner at the GPU's memory less a reserve for kernel workspace, then
simulated work-conserving (`dynamic`), with each GPU lane's order fixed (`deterministic`, the
ablation of TURNIP Figure 14), level by level (`levelwise`, DISCO Figure 2), and with every weight
already in GPU memory (`resident`, the lower bound). To stay within minutes, big settings use coarse tiles and are
simulated for a few layers and extrapolated linearly to the model's depth (`--full` simulates all).

    PYTHONPATH=. python benchmarks/predict_llama.py              # the quick table
    PYTHONPATH=. python benchmarks/predict_llama.py --full --seqs 1024,4096
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import workloads
from disco_ray.bench import modes, profiles
from disco_ray.bench.simulate import simulate
from disco_ray.graph.errors import CapacityError
from workloads.llama import PRESETS

MACHINES = {"p100": (profiles.p100, 4), "a100": (profiles.a100, 8)}
# what the papers state in their text; the inference times themselves are plotted (TURNIP Figures 10-12,
# DISCO Figures 12, 13, 15), not given as numbers
PAPER = {
    "p100": "TURNIP Fig. 14: nondeterministic vs deterministic ordering, P100 inference: 6.45% faster on average",
    "a100": "TURNIP Fig. 14: nondeterministic vs deterministic ordering, A100 inference: 4.02% faster on average",
}
CLAIMS = [
    "TURNIP §8: 7B and 65B prefill run for prompts of 1K-16K tokens (batched) and single prompts up to 32K",
    "TURNIP §8: the P100 server has only 64 GB of GPU RAM in all, less than 65B's 130 GB of fp16 weights",
    "TURNIP §8: TURNIP typically had the lowest latency, ahead of ZeRO Inference and FlexGen",
]


@dataclass
class Row:
    model: str
    machine: str
    seq: int
    tile: int
    layers: int  # simulated
    dynamic: float  # seconds for the whole model
    deterministic: float
    levelwise: float
    resident: float  # every weight already in GPU memory, unlimited capacity
    reload_gb: float  # bytes moved host -> GPU per GPU (inputs + reloads), whole model
    offloads: int
    busy: dict
    vertices: int
    plan_s: float
    note: str = ""


def tile_for(seq: int, gpus: int) -> int:
    """Coarse query tiles: at most 4 per prompt, at least 512 rows."""
    return max(512, seq // 4)


def _sim(model: str, machine: str, seq: int, layers: int, reserve: float, lookahead: int):
    prof, gpus = MACHINES[machine]
    tile = tile_for(seq, gpus)
    w = workloads.build(
        "llama_prefill",
        preset=model,
        gpus=gpus,
        seq=seq,
        tile=tile,
        layers=layers,
        lookahead=lookahead,
        materialize=False,
    )
    tg = w.taskgraph
    cap = int(prof.memory * (1 - reserve))
    t0 = time.perf_counter()
    from planner import build_memgraph

    mg = build_memgraph(tg, cap, order=w.order())  # layer by layer, tile by tile
    plan_s = time.perf_counter() - t0
    dyn = simulate(mg, tg, prof)
    det = simulate(modes.deterministic(mg), tg, prof)
    lvl = simulate(modes.levelwise(mg, tg, w.levels), tg, prof)
    # the lower bound: unlimited memory and every input already on its GPU (loads cost only their launch)
    mem = simulate(modes.in_memory(tg, order=w.order()), tg, prof.with_(h2d=float("inf")))
    stats = mg.statistics()
    loaded = [0] * gpus
    for v in mg.vertices:
        if v.kind.value in ("input", "reload"):
            loaded[v.gpu] += v.out.nbytes
    return dict(
        tile=tile,
        dyn=dyn.makespan,
        det=det.makespan,
        lvl=lvl.makespan,
        mem=mem.makespan,
        loaded=max(loaded),
        offloads=stats["by_kind"]["offload"],
        busy=dyn.busy[0],
        vertices=len(mg),
        plan_s=plan_s,
    )


def predict(
    model: str, machine: str, seq: int, full: bool, short: tuple[int, int], reserve: float, lookahead: int = 2
) -> Row:
    depth = PRESETS[model]["layers"]
    if full:
        r = _sim(model, machine, seq, depth, reserve, lookahead)
        scale = {k: r[k] for k in ("dyn", "det", "lvl", "mem", "loaded", "offloads")}
        note = "full"
    else:
        a, b = short
        ra, rb = (
            _sim(model, machine, seq, a, reserve, lookahead),
            _sim(model, machine, seq, b, reserve, lookahead),
        )
        # linear in depth: the fill and drain of the first and last layers, then a steady per-layer cost
        scale = {
            k: ra[k] + (rb[k] - ra[k]) * (depth - a) / (b - a)
            for k in ("dyn", "det", "lvl", "mem", "loaded", "offloads")
        }
        r = rb
        r["plan_s"] += ra["plan_s"]
        note = f"extrapolated from {a} and {b} layers"
    return Row(
        model,
        machine,
        seq,
        r["tile"],
        depth,
        scale["dyn"],
        scale["det"],
        scale["lvl"],
        scale["mem"],
        scale["loaded"] / 1e9,
        round(scale["offloads"]),
        r["busy"],
        r["vertices"],
        r["plan_s"],
        note,
    )


# measured on the lent H100 with workloads.baselines (ms, best of 2-3, 2026-11-22): in memory, torch
# double-buffered prefetch, torch copy-then-compute; one GPU, fp16, weights in pinned host memory
MEASURED_H100 = {
    ("matmul_chain", 2048): (5.9, 40.4, 48.7),
    ("matmul_chain", 8192): (23.4, 43.1, 66.1),
    ("matmul_chain", 14336): (41.6, 48.6, 86.3),
    ("llama7b_8layers", 1024): (8.8, 60.9, 73.4),
    ("llama7b_8layers", 4096): (31.1, 65.2, 96.1),
    ("llama7b_8layers", 16384): (145.4, 155.1, 207.4),
}


def calibration() -> None:
    """The simulator against measurements: resident ~ in memory, dynamic ~ prefetch, levelwise ~ naive."""
    from planner import build_memgraph

    prof = profiles.h100
    print(
        "simulator (h100 profile) vs measured on the lent H100, ms: resident/in-memory, dynamic/prefetch, "
        "levelwise/naive"
    )
    for (name, size), meas in MEASURED_H100.items():
        if name == "matmul_chain":
            w = workloads.build(
                name, n=16, gpus=1, tokens=size, hidden=8192, dtype="float16", materialize=False
            )
            room = 2 * w.taskgraph["y0_g0"].nbytes + 3 * w.taskgraph["x0_g0"].nbytes  # double buffering
        else:
            w = workloads.build(
                "llama_prefill",
                preset="7b",
                gpus=1,
                layers=8,
                seq=size,
                tile=min(size, 4096),
                materialize=False,
            )
            room = 2 * sum(w.taskgraph[x].nbytes for x in w.weights) // 8 + 16 * size * 4096 * 2
        tg = w.taskgraph
        mg = build_memgraph(tg, room + 4096, order=w.order())
        sim = (
            simulate(modes.in_memory(tg), tg, prof.with_(h2d=float("inf"))).makespan,
            simulate(mg, tg, prof).makespan,
            simulate(modes.levelwise(mg, tg, w.levels), tg, prof).makespan,
        )
        cells = "  ".join(f"{s * 1e3:6.1f} / {m:6.1f}" for s, m in zip(sim, meas))
        print(f"  {name:>16} {size:>6}: {cells}")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b,65b")
    ap.add_argument("--machines", default="p100,a100")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--full", action="store_true", help="simulate every layer instead of extrapolating")
    ap.add_argument("--short", default="2,4", help="the two depths to extrapolate from")
    ap.add_argument("--reserve", type=float, default=0.15, help="fraction of GPU memory kept for workspace")
    ap.add_argument(
        "--lookahead",
        type=int,
        default=2,
        help="serial order: attention of tile t+k before the MLP of tile t (helps the deterministic order)",
    )
    ap.add_argument("--no-calibration", action="store_true", help="skip the simulator-vs-H100 table")
    args = ap.parse_args(argv)
    if not args.no_calibration:
        calibration()
    short = tuple(int(x) for x in args.short.split(","))
    print(
        "LLaMA prefill, one prompt, fp16, weights start in host memory; simulated (disco_ray.bench.simulate); "
        f"serial order layer by layer, tile by tile, lookahead {args.lookahead}"
    )
    for m, (p, g) in MACHINES.items():
        print(
            f"  {m}: {g} GPUs x {p.memory / 2**30:.0f} GiB, fp16 {p.flops['float16'] / 1e12:.1f} TFLOP/s x "
            f"{p.efficiency}, H2D {p.h2d / 1e9:.0f} GB/s, peer {p.peer / 1e9:.0f} GB/s, {p.streams} streams"
        )
    hdr = (
        f"{'model':>5} {'gpus':>7} {'seq':>6} {'tile':>5} {'dynamic s':>10} {'determ. s':>10} {'speedup':>8} {'levelw. s':>10} "
        f"{'resident s':>10} {'H2D GB/gpu':>10} {'offl':>5} {'compute':>8} {'h2d':>5} {'verts':>6} {'plan s':>7}  note"
    )
    print(hdr)
    speedups: dict[str, list[float]] = {}
    for model in args.models.split(","):
        for machine in args.machines.split(","):
            for seq in (int(s) for s in args.seqs.split(",")):
                gpus = MACHINES[machine][1]
                try:
                    r = predict(model, machine, seq, args.full, short, args.reserve, args.lookahead)
                except CapacityError as e:
                    print(f"{model:>5} {gpus}x{machine:>5} {seq:>6}  does not fit: {e}")
                    continue
                sp = r.deterministic / r.dynamic - 1
                speedups.setdefault(machine, []).append(sp)
                print(
                    f"{model:>5} {gpus}x{machine:>5} {seq:>6} {r.tile:>5} {r.dynamic:>10.3f} "
                    f"{r.deterministic:>10.3f} {sp:>7.2%} {r.levelwise:>10.3f} {r.resident:>10.3f} {r.reload_gb:>10.1f} "
                    f"{r.offloads:>5} {r.busy['compute']:>8.0%} {r.busy['h2d']:>5.0%} {r.vertices:>6} "
                    f"{r.plan_s:>7.1f}  {r.note}",
                    flush=True,
                )
    print()
    for machine, sps in speedups.items():
        print(f"predicted {machine} average speedup of dynamic over deterministic: {sum(sps) / len(sps):.2%}")
        print(f"  paper: {PAPER[machine]}")
    for c in CLAIMS:
        print(f"  paper: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
