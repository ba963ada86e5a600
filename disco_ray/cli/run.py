"""`disco-ray run`: run a TaskGraph file of one's own (or a built-in workload) on the ray or local engine.

    disco-ray run TASKGRAPH|WORKLOAD [key=value ...] [--inputs IN.npz] --out OUT.npz
        [--capacity SIZE[,SIZE...]] [--capacity-gpu G=SIZE] [--plan MEMGRAPH] [--progress]
        [--check-reference] [--engine ray|local] [--backend cpu|cuda] [--streams 5] [--ahead N]
        [--check] [--trace trace.json] [--seed 0] [--delay LO,HI] [--timeout S] [--stall-timeout S]

Inputs and outputs are .npz files keyed by TaskGraph ids (`disco_ray.cli.npz`; bfloat16 as raw
bits plus a dtype entry), and `disco_ray.cli.target` says which inputs a file or a workload gets
by default. `--check-reference` compares the outputs with the reference (the graph
evaluated by plain torch, or the workload's own torch code) and exits 1 on a mismatch. Progress
is drawn when stderr is a terminal, or logged every tenth of the run with `--progress`.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable

from actors.options import STALL_S
from disco_ray.driver.placement import add_cluster_args, cluster_kwargs
from disco_ray.graph.errors import DiscoError, UsageError

from .app import closing_after_error, command, positive_int, seconds_arg, writable_file

log = logging.getLogger("disco_ray")


MAX_STREAMS = 256  # threads (cpu) or CUDA streams per GPU; TURNIP uses 5
MAX_AHEAD = 1024


def delay_arg(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad delay {text[:40]!r} (want LO,HI in seconds, e.g. 0,0.002)"
        ) from None
    if not (math.isfinite(hi) and 0 <= lo <= hi <= 60):
        raise argparse.ArgumentTypeError(f"bad delay {text!r}: want 0 <= LO <= HI <= 60 seconds")
    return lo, hi


@command(
    "run",
    help="run a TaskGraph file or a workload (plan, execute, write outputs)",
    description="Plan TASKGRAPH (a file, or a built-in WORKLOAD) for GPUs of --capacity bytes "
    "(or use --plan) and run it; write the outputs, keyed by TaskGraph id, to --out.",
)
def add_run(p) -> None:
    from .target import add_run_target_args

    add_run_target_args(p)  # TARGET [key=value ...] --inputs --seed --capacity --host-capacity --disk
    p.add_argument("--plan", metavar="MEMGRAPH", help="run this MemGraph instead of planning")
    p.add_argument(
        "--trusted-plan",
        action="store_true",
        help="run --plan without verifying it against the TaskGraph first (a cycle is still refused)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=writable_file("--out"),
        metavar="OUT.npz",
        help="where to write the outputs",
    )
    add_engine_args(p)
    p.add_argument("--check", action="store_true", help="run the sanitizer (slower)")
    p.add_argument(
        "--check-reference",
        action="store_true",
        help="compare the outputs with the reference (plain torch); exit 1 if they differ",
    )
    p.add_argument(
        "--progress", action="store_true", help="report progress (a bar on a terminal, else a line per 10%%)"
    )
    p.add_argument(
        "--trace",
        type=writable_file("--trace"),
        metavar="TRACE.json",
        help="write a Chrome/Perfetto trace of the run",
    )
    p.add_argument(
        "--delay", type=delay_arg, metavar="LO,HI", help="debug: sleep uniform(LO, HI) s before each vertex"
    )
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up after S seconds")
    add_stall_arg(p)
    add_cluster_args(p)  # --address, --placement, --gpus-per-worker, --cpus-per-worker
    p.set_defaults(func=cmd_run)


def add_stall_arg(p: argparse.ArgumentParser) -> None:
    """--stall-timeout: how long a silent Ray actor (stopped, hung) may hold a run."""
    p.add_argument(
        "--stall-timeout",
        type=seconds_arg,
        default=STALL_S,
        metavar="S",
        help="ray engine: a worker that answers no heartbeat for S seconds (stopped or hung; a long "
        f"kernel still answers) ends the run naming it (default {STALL_S:g})",
    )


def add_model_run_args(p: argparse.ArgumentParser) -> None:
    """What a checkpoint's commands (generate, finetune) run with: --weights, the engine's options
    and the cluster's."""
    from disco_ray.driver.placement import add_cluster_args

    p.add_argument(
        "--weights",
        choices=["host", "disk"],
        default="host",
        help="keep each worker's weight shards in host memory after one read (host), or read them "
        "from the checkpoint at each load (disk: no host copy)",
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        help="read the decoder layers' linear weights quantized (group-wise min-max): stored, "
        "moved and streamed packed, dequantized where used (docs/QUANTIZATION.md)",
    )
    p.add_argument(
        "--quant-group",
        type=positive_int,
        default=64,
        metavar="N",
        help="elements per scale and zero point of a quantized weight's rows (default 64)",
    )
    add_engine_args(p)
    add_stall_arg(p)
    add_cluster_args(p)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--engine, --backend, --streams, --ahead (for `disco-ray run` and bench)."""
    p.add_argument("--engine", choices=["ray", "local"], default="ray")
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--streams", type=int, default=5, help="streams per GPU (default 5)")
    p.add_argument(
        "--ahead",
        type=int,
        metavar="N",
        help="kernels a stream may hold, launched, behind the one it runs (0: launch when ready; "
        "default: 4 on cuda, 0 on cpu)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Program keyword arguments from the options of `add_engine_args`, checked."""
    if not 1 <= args.streams <= MAX_STREAMS:
        raise UsageError(f"--streams must be in 1..{MAX_STREAMS}, got {args.streams}")
    if args.ahead is not None and not 0 <= args.ahead <= MAX_AHEAD:
        raise UsageError(f"--ahead must be in 0..{MAX_AHEAD}, got {args.ahead}")
    return {"engine": args.engine, "backend": args.backend, "streams": args.streams, "ahead": args.ahead}


def model_run_kwargs(args: argparse.Namespace, gpus: int) -> dict:
    """LlamaModel / LoraTrainer keyword arguments from the options of `add_model_run_args` and
    `add_tier_args`, checked."""
    from disco_ray.driver.placement import cluster_kwargs

    from .app import host_capacity_of

    kw = engine_kwargs(args)
    kw.update(weights=args.weights, host_capacity=host_capacity_of(args, gpus), disk_dir=args.disk)
    kw.update(stall_timeout=args.stall_timeout, quantize=args.quantize, quant_group=args.quant_group)
    if args.engine == "ray":
        kw.update(cluster_kwargs(args))
    return kw


def progress_arg(enabled: bool, total: int) -> bool | Callable[[int], None] | None:
    """What Program.run's `progress` gets: a bar on a terminal; with `enabled` and no terminal, a
    log line for each tenth of the `total` vertices reached (at most ten lines, the last at 100%);
    else nothing."""
    if sys.stderr.isatty():
        return True
    if not enabled:
        return None
    shown = [0]  # tenths reported so far

    def report(n: int) -> None:
        tenth = 10 * min(n, total) // max(total, 1)
        if tenth > shown[0]:
            shown[0] = tenth
            log.info("run: %d of %d vertices done (%d%%)", n, total, 100 * n // max(total, 1))

    return report


def check_arenas_fit(mg, where: str) -> None:
    """UsageError, before any actor starts, when a run on this machine's cpu backend could not
    allocate its arenas (they are host memory there): one allocation failure per worker otherwise."""
    from workloads import available_memory

    need = sum(mg.capacity) + sum(mg.host_capacity)
    free = available_memory()
    if free is not None and need > free:
        raise UsageError(
            f"{where}: the plan's arenas and host stores need {need} bytes of host memory on the cpu "
            f"backend (capacity {max(mg.capacity)} bytes per GPU), more than the {free} bytes free; "
            "give a smaller --capacity"
        )


def given_plan(args: argparse.Namespace, tg, kw: dict):
    """The Program of `--plan`, verified against the TaskGraph unless `--trusted-plan`: an error
    names the plan file (a plan that is not this TaskGraph's never starts anything)."""
    from disco_ray.driver.program import Program
    from disco_ray.graph import formats

    mg = formats.load_memgraph(args.plan)
    try:
        return Program(tg, mg, trusted=args.trusted_plan, **kw)
    except DiscoError as e:
        raise type(e)(f"{args.plan}: not a plan of {args.target}: {e}") from None


def cmd_run(args) -> int:
    from disco_ray.bench.report import check_outputs
    from disco_ray.driver.api import compile
    from disco_ray.graph.trace import format_summary

    from .app import _error, capacity_of, host_capacity_of
    from .target import load_target

    if not str(args.out).endswith(".npz"):
        raise UsageError(f"--out {args.out}: the outputs are written as .npz")
    kw = engine_kwargs(args)
    w = load_target(args)  # inputs checked here: refused before anything is planned or started
    tg = w.taskgraph
    capacity = capacity_of(args, tg.gpus)
    host_capacity = host_capacity_of(args, tg.gpus)
    kw["disk_dir"] = args.disk
    cluster = cluster_kwargs(args)  # checked on every engine: a bad value is refused either way
    if args.engine == "ray":
        kw.update(cluster)
        from disco_ray.driver import watch

        watch.GCS_LOST_EXITS = True  # a lost GCS ends this command with one line, not Ray's minute
    if args.plan:
        if capacity is not None or host_capacity is not None:
            raise UsageError("--plan runs a given MemGraph: --capacity and --host-capacity do not apply")
        prog = given_plan(args, tg, kw)
    else:
        try:
            prog = compile(tg, capacity, host_capacity=host_capacity, **kw)
        except DiscoError as e:  # name the graph, as `plan` does
            raise type(e)(f"{args.target}: {e}") from None
    if args.backend == "cpu" and not getattr(args, "address", None):
        check_arenas_fit(prog.mg, args.plan or args.target)
    with closing_after_error(prog):
        outs = prog.run(
            w.inputs,
            check=args.check,
            trace=args.trace,
            delay=args.delay,
            seed=args.seed,
            timeout=args.timeout,
            stall_timeout=args.stall_timeout,
            progress=progress_arg(args.progress, len(prog.mg)),
        )
    from .npz import save_npz

    save_npz(args.out, outs)
    if prog.last_summary is not None:
        log.info(format_summary(prog.last_summary))
    log.info("wrote %s%s", args.out, f" and {args.trace}" if args.trace else "")
    if args.check_reference:
        ref = w.reference(w.inputs)
        c = check_outputs(outs, ref)
        if not c["ok"]:
            _error(
                f"output {c['output']} differs from the reference (relative error "
                f"{c['max_rel_err']:.3g} > {c['tol']:.0e})"
            )
            return 1
        log.info(
            "outputs match the reference: max relative error %.2g (tolerance %.0e)",
            c["max_rel_err"],
            c["tol"],
        )
    return 0
