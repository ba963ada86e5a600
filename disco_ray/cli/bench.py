"""`disco-ray bench`: run one workload, or a TaskGraph file of one's own, in several modes on one
memory budget and compare them.

    disco-ray bench TASKGRAPH|WORKLOAD [key=value ...] [--inputs IN.npz] [--capacity SIZE[,SIZE...]]
        [--capacity-gpu G=SIZE] [--modes dynamic,deterministic,levelwise,in_memory,torch_naive,...]
        [--backend cpu|cuda] [--engine ray|local] [--simulate PROFILE] [--repeat N] [--warmup N]
        [--out DIR] [--address auto|ADDR]

Every mode runs the same graph (same inputs) and, for the runtime modes, the same capacity. Each
mode's outputs are checked against the reference (the workload's own torch code, or for a file
the graph evaluated by plain torch; tolerance by dtype, `disco_ray.bench.report.TOLERANCE`); a
mismatch fails the command (exit 1) naming the mode, after the table is printed. By default
every mode that applies runs: levelwise where the graph has levels (a file's are its longest-path
depths), the torch baselines for the workloads that have one. With --simulate PROFILE the runtime
modes are simulated under that device profile instead (nothing runs, so nothing is checked).

The `/ bound` column is makespan / a lower bound (`disco_ray.bench.bound`: from the profile, or
from kernels timed alone on the GPU; none on the cpu backend, where the column is left out and a
note says why). With --warmup 0 the timed runs include the first, cold one, which is marked.

Written to DIR, and listed when done: results.json (every figure, the device/backend/profile,
per-mode summaries and, on Ray with several workers, per-node and per-link figures),
timeline.png (a panel per runtime mode: each GPU's compute / H2D / D2H / peer lanes over time
and its arena and host-store bytes, as in DISCO Figures 2-3), trace.json (the dynamic run's
Chrome trace, or the first runtime mode's) and trace.MODE.json for the other modes. Such files
left by an earlier bench in DIR that this one did not write are removed.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

from disco_ray.graph.errors import UsageError

from .app import command, seconds_arg
from .paths import writable_dir

log = logging.getLogger("disco_ray")


@command(
    "bench",
    help="compare execution modes and torch baselines on one workload or TaskGraph file",
    description="Run TASKGRAPH (a file) or WORKLOAD in each mode on the same memory budget; check "
    "outputs; print a table; write results.json, timeline.png and traces to --out.",
)
def add_bench(p) -> None:
    from disco_ray.driver.placement import add_cluster_args

    from .run import add_engine_args
    from .target import add_run_target_args

    add_run_target_args(p)  # TARGET [key=value ...] --inputs --seed --capacity --host-capacity --disk
    p.add_argument(
        "--modes",
        help="comma-separated modes: dynamic, deterministic, levelwise, in_memory, torch_naive, "
        "torch_prefetch, torch_in_memory (default: all that apply but torch_in_memory)",
    )
    p.add_argument(
        "--order",
        choices=["builder", "planner"],
        default="planner",
        help="serial order to plan in: the planner's own (a list schedule of the graph; default) or the "
        "workload builder's (level by level)",
    )
    add_engine_args(p)  # --engine, --backend, --streams, --ahead
    p.add_argument(
        "--simulate", metavar="PROFILE", help="simulate under a device profile (h100, a100, p100, t4, unit)"
    )
    p.add_argument("--repeat", type=int, default=1, help="timed runs per mode; the best counts (default 1)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed runs per mode before the timed ones (default 1)"
    )
    p.add_argument(
        "--out",
        default="bench_out",
        type=writable_dir("--out"),
        metavar="DIR",
        help="output folder (default bench_out)",
    )
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up a run after S seconds")
    add_cluster_args(p)  # --address, --placement, --gpus-per-worker, --cpus-per-worker


def _settings(args):
    """The BenchSettings of the command's options (capacities not yet read: they need the graph)."""
    from disco_ray.bench.run import BenchSettings
    from disco_ray.driver.placement import cluster_kwargs

    from .run import engine_kwargs

    engine = engine_kwargs(args)  # checked before anything is built
    if args.repeat < 1 or args.warmup < 0:
        raise UsageError(f"--repeat must be >= 1 and --warmup >= 0, got {args.repeat}, {args.warmup}")
    ray = args.engine == "ray" and not args.simulate  # only a run on Ray reads the cluster options
    settings = BenchSettings(
        modes=None if args.modes is None else tuple(args.modes.split(",")),
        order=args.order,
        simulate=args.simulate or None,
        repeat=args.repeat,
        warmup=args.warmup,
        timeout=args.timeout,
        disk_dir=args.disk,
        **engine,
        **(cluster_kwargs(args) if ray else {}),
    )
    settings.validate()  # an unknown profile or mode is refused before the workload is built
    return settings


def cmd_bench(args) -> int:
    from disco_ray.bench import output, report
    from disco_ray.bench.run import bench, select_modes

    from .app import _error, capacity_of, host_capacity_of
    from .target import load_target

    settings = _settings(args)
    w = load_target(args, materialize=settings.simulate is None)
    settings = replace(
        settings,
        capacity=capacity_of(args, w.taskgraph.gpus, measured=False),
        host_capacity=host_capacity_of(args, w.taskgraph.gpus),
    )
    settings = replace(settings, modes=tuple(select_modes(w, settings)))  # refused before --out is made
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = bench(w, settings)
    has_bound = res.bound["seconds"] is not None
    unit, scale = res.unit
    head = output.header(w, settings, res)
    print(head)
    print(report.format_table(res.rows, unit, scale, bound=has_bound))
    if has_bound:
        print(
            f"lower bound {res.bound['seconds'] * scale:.4g} {unit} ({res.bound['source']}); "
            "'vs levelwise' = levelwise makespan / makespan; '/ bound' = makespan / lower bound"
        )
    else:
        print(f"'vs levelwise' = levelwise makespan / makespan; {res.bound['source']}")
    if settings.simulate is not None:
        print(f"simulated under profile {settings.simulate}: nothing ran, so no outputs were checked")
    elif settings.warmup == 0:
        print("--warmup 0: the timed runs include each mode's first run, which is cold (marked)")
    written = output.write(out, w, settings, res, head, sys.argv[1:])
    log.info("wrote %s", ", ".join(str(p) for p in written))
    bad = res.mismatches()
    if bad:
        _error(
            "; ".join(
                f"mode {r['mode']}: output {r['check']['output']} differs from the reference "
                f"(relative error {r['check']['max_rel_err']:.3g} > {r['check']['tol']:.0e})"
                for r in bad
            )
        )
        return 1
    return 0
