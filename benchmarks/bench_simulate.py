"""The simulator against the runtime: a local-engine run's trace replayed, predicted vs measured.

    PYTHONPATH=. python benchmarks/bench_simulate.py [--repeat 10] [--json out.json]

For each case (the tiny LLaMA prefill, workloads/llama.py, planned with room for everything and
with a tenth of it; the matmul chain, workloads/matmul_chain.py, with its defaults), the graph
runs --repeat times on the `local` engine and the cpu backend (after one warm-up run). The runs
are split in two halves, alternately:

- from the first half's traces (disco_ray.bench.replay): each vertex's duration (interquartile
  mean), the host's lag per completion on the same stream (`done_s`) and per stream thread woken
  (`wake_s`), and, measured here, how long the reporter's sleep of flush_s lasts (its period
  while busy);
- the second half gives the measured makespan (median; first start to last end of the trace).

The simulator (disco_ray.bench.simulate, which drives the runtime's own Scheduler, WorkerCore,
StreamSlots, lanes and Reporter) replays the first half and predicts the second. Printed per
case: vertices, the measured makespan (median, and the range), the prediction, the error, and
the prediction without host costs (done_s, wake_s and the reporter's lag all 0), which says what
the host model adds. A benchmark: it measures and prints; tests/test_sim_engine.py holds the
checks that do not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import workloads  # noqa: E402
from disco_ray.bench.replay import makespan, replay  # noqa: E402
from disco_ray.bench.sim_engine import Host  # noqa: E402
from disco_ray.bench.simulate import simulate  # noqa: E402
from disco_ray.driver.program import Program  # noqa: E402
from planner import build_memgraph, roomy_capacity  # noqa: E402

FLUSH_S = 1e-3  # WorkerConfig.flush_s, the runtime's default
CASES = [  # (workload, its parameters, capacity as a fraction of its tensors per GPU; None: room)
    ("llama_prefill", {"preset": "tiny"}, None),
    ("llama_prefill", {"preset": "tiny"}, 0.1),
    ("matmul_chain", {}, None),
]


def sleep_period(seconds: float, n: int = 200) -> float:
    """The median time a sleep of `seconds` lasts on this host (the reporter's period)."""
    took = []
    for _ in range(n):
        t = time.perf_counter()
        time.sleep(seconds)
        took.append(time.perf_counter() - t)
    return statistics.median(took)


def run_case(name: str, kw: dict, frac: float | None, repeat: int) -> dict:
    w = workloads.build(name, **kw)
    tg = w.taskgraph
    need = max(tg.statistics()["tensor_bytes_per_gpu"])
    mg = build_memgraph(tg, roomy_capacity(tg) if frac is None else int(need * frac))
    with Program(tg, mg, engine="local", backend="cpu", flush_s=FLUSH_S) as prog:
        prog.run(w.inputs)  # warm-up: arenas, first loads
        runs = [prog.run(w.inputs, details=True).records for _ in range(repeat)]
    fit, held = runs[0::2], runs[1::2]
    period = sleep_period(FLUSH_S)
    cost, host = replay(mg, fit, flush_s=period)
    pred = simulate(mg, tg, cost, host=host).makespan
    bare = simulate(mg, tg, cost, host=Host()).makespan
    spans = [makespan(r) for r in held]
    measured = statistics.median(spans)
    kinds = mg.statistics()["by_kind"]
    return {
        "workload": name,
        "plan": "roomy" if frac is None else f"{frac:g} of tensors",
        "vertices": len(mg),
        "moves": kinds["offload"] + kinds["reload"],
        "measured_ms": measured * 1e3,
        "measured_range_ms": [min(spans) * 1e3, max(spans) * 1e3],
        "predicted_ms": pred * 1e3,
        "error_pct": 100 * (pred / measured - 1),
        "no_host_ms": bare * 1e3,
        "done_us": host.done_s * 1e6,
        "wake_us": host.wake_s * 1e6,
        "report_period_ms": period * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=10, help="runs per case after a warm-up (split in two)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = [run_case(name, kw, frac, max(args.repeat, 2)) for name, kw, frac in CASES]
    head = f"{'workload':14s} {'plan':16s} {'vertices':>8s} {'measured ms':>18s} {'predicted':>10s} {'error':>7s}"
    print(head + f" {'no host':>8s}   host: done / wake us, report period ms")
    for r in rows:
        lo, hi = r["measured_range_ms"]
        meas = f"{r['measured_ms']:.2f} ({lo:.1f}-{hi:.1f})"
        print(
            f"{r['workload']:14s} {r['plan']:16s} {r['vertices']:8d} {meas:>18s} {r['predicted_ms']:10.2f} "
            f"{r['error_pct']:+6.1f}% {r['no_host_ms']:8.2f}   {r['done_us']:.1f} / {r['wake_us']:.1f}, "
            f"{r['report_period_ms']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
