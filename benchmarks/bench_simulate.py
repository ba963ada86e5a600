"""The simulator against the runtime: a local-engine run's trace replayed, predicted vs measured.

    PYTHONPATH=. python benchmarks/bench_simulate.py [--repeat 10] [--json out.json]

For each case (the tiny LLaMA prefill, workloads/llama.py, planned with room for everything and
with a tenth of it; the matmul chain, workloads/matmul_chain.py, with its defaults), the graph
runs --repeat times on the `local` engine and the cpu backend (after one warm-up run). The runs
are split in two halves, alternately:

- from the first half's traces (disco_ray.bench.replay): each vertex's duration (interquartile
  mean), the host's lag per completion on the same stream (`done_s`) and per stream thread woken
  (`wake_s`); measured beside those runs, how long a sleep of flush_s lasts under their load
  (the reporter's period while busy; a thread sleeping as its loop does, the mean), and the
  runtime's own measure of a report call's host time (the workers' `report_call_ms`);
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
import threading
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


class Sleeper:
    """A thread that sleeps `seconds` over and over, as the reporter's busy loop does, while
    `on`: how long those sleeps last under the runs' load (GIL, cores) is the reporter's period
    (a sleep on an idle host is shorter)."""

    def __init__(self, seconds: float):
        self.seconds, self.took = seconds, []
        self.on = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.on.wait()
            if self._closing:
                return
            t = time.perf_counter()
            time.sleep(self.seconds)
            if self.on.is_set():  # it slept beside a run throughout
                self.took.append(time.perf_counter() - t)

    def close(self) -> float:
        """Stops the thread; the mean sleep (a path through several reporter passes adds their
        means)."""
        self._closing = True
        self.on.set()
        self._thread.join()
        return statistics.fmean(self.took)


def run_case(name: str, kw: dict, frac: float | None, repeat: int) -> dict:
    w = workloads.build(name, **kw)
    tg = w.taskgraph
    need = max(tg.statistics()["tensor_bytes_per_gpu"])
    mg = build_memgraph(tg, roomy_capacity(tg) if frac is None else int(need * frac))
    with Program(tg, mg, engine="local", backend="cpu", flush_s=FLUSH_S) as prog:
        prog.run(w.inputs)  # warm-up: arenas, first loads
        sleeper = Sleeper(FLUSH_S)
        runs = []
        for i in range(repeat):
            if i % 2 == 0:  # beside the fit runs only: the held ones run as the runtime alone
                sleeper.on.set()
            runs.append(prog.run(w.inputs, details=True).records)
            sleeper.on.clear()
        period = sleeper.close()
        calls = [wk["report_call_ms"] / 1e3 for wk in prog.statistics()["engine"]["workers"]]
    fit, held = runs[0::2], runs[1::2]
    cost, host = replay(mg, fit, flush_s=period, report_s=statistics.fmean(calls))
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
        "report_call_us": host.report_s * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=10, help="runs per case after a warm-up (split in two)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = [run_case(name, kw, frac, max(args.repeat, 2)) for name, kw, frac in CASES]
    head = f"{'workload':14s} {'plan':16s} {'vertices':>8s} {'measured ms':>18s} {'predicted':>10s} {'error':>7s}"
    print(head + f" {'no host':>8s}   host: done / wake / report call us, report period ms")
    for r in rows:
        lo, hi = r["measured_range_ms"]
        meas = f"{r['measured_ms']:.2f} ({lo:.1f}-{hi:.1f})"
        print(
            f"{r['workload']:14s} {r['plan']:16s} {r['vertices']:8d} {meas:>18s} {r['predicted_ms']:10.2f} "
            f"{r['error_pct']:+6.1f}% {r['no_host_ms']:8.2f}   {r['done_us']:.1f} / {r['wake_us']:.1f} / {r['report_call_us']:.1f}, "
            f"{r['report_period_ms']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
