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

import inspect
import logging
import os
import platform
import sys
import time
from pathlib import Path

from disco_ray.graph.errors import UsageError

REPS = 9  # timed copies of the H2D probe
BASELINE_WORKLOADS = ("matmul_chain", "llama_prefill")  # workloads.baselines knows these
log = logging.getLogger("disco_ray")


def add_bench(sub) -> None:
    from disco_ray.driver.placement import add_cluster_args

    from .app import add_capacity_args, add_tier_args, seconds_arg
    from .run import add_engine_args
    from .target import add_target_args

    p = sub.add_parser(
        "bench",
        help="compare execution modes and torch baselines on one workload or TaskGraph file",
        description="Run TASKGRAPH (a file) or WORKLOAD in each mode on the same memory budget; check "
        "outputs; print a table; write results.json, timeline.png and traces to --out.",
    )
    add_target_args(p)  # TARGET [key=value ...] --inputs --seed
    add_capacity_args(p, default="everything fits")
    add_tier_args(p)  # --host-capacity, --disk
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
        "--simulate", metavar="PROFILE", help="simulate under a device profile (h100, a100, p100, unit)"
    )
    p.add_argument("--repeat", type=int, default=1, help="timed runs per mode; the best counts (default 1)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed runs per mode before the timed ones (default 1)"
    )
    p.add_argument("--out", default="bench_out", metavar="DIR", help="output folder (default bench_out)")
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up a run after S seconds")
    add_cluster_args(p)  # --address, --placement, --gpus-per-worker, --cpus-per-worker


def _order(args, w) -> list[str] | None:
    """The builder's serial order (`Workload.order`), or None for the planner's default."""
    return w.order() if args.order == "builder" else None


def _modes(args, w, simulated: bool) -> list[str]:
    """The modes asked for, or every one that applies; UsageError for one that cannot run."""
    from disco_ray.bench import report as bench

    baseline = w.name in BASELINE_WORKLOADS and "file" not in w.params
    if args.modes is None:
        modes = [m for m in bench.RUNTIME_MODES if m != "levelwise" or w.levels]
        if baseline and not simulated:
            modes += ["torch_naive", "torch_prefetch"]
        return modes
    try:
        modes = bench.parse_modes(args.modes)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if "levelwise" in modes and not w.levels:
        raise UsageError(f"workload {w.name} has no levels: mode levelwise cannot run")
    torch_modes = [m for m in modes if m in bench.TORCH_MODES]
    if torch_modes and not simulated and not baseline:
        raise UsageError(f"no torch baseline for workload {w.name} (modes {', '.join(torch_modes)})")
    return modes


def cmd_bench(args) -> int:
    from disco_ray.bench import report as bench

    from .app import capacity_of, host_capacity_of
    from .run import engine_kwargs
    from .target import load_target

    engine_kwargs(args)  # checked before anything is built
    if args.repeat < 1 or args.warmup < 0:
        raise UsageError(f"--repeat must be >= 1 and --warmup >= 0, got {args.repeat}, {args.warmup}")
    cost = None
    if args.simulate:
        from disco_ray.bench import profiles

        try:
            cost = profiles.get(args.simulate)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.modes is not None:
        try:
            bench.parse_modes(args.modes)  # a bad mode is refused before the workload is built
        except ValueError as e:
            raise UsageError(str(e)) from None
    w = load_target(args, materialize=cost is None)
    args.capacity = capacity_of(args, w.taskgraph.gpus)
    args.host_capacity = host_capacity_of(args, w.taskgraph.gpus)
    modes = _modes(args, w, cost is not None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = _simulated(args, w, modes, cost) if cost is not None else _measured(args, w, modes)
    has_bound = res["bound"]["seconds"] is not None
    rows = bench.finish_rows(res["rows"], res["bound"]["seconds"])
    unit, scale = res.get("unit", ("ms", 1e3))
    header = _header(args, w, res)
    print(header)
    print(bench.format_table(rows, unit, scale, bound=has_bound))
    if has_bound:
        print(
            f"lower bound {res['bound']['seconds'] * scale:.4g} {unit} ({res['bound']['source']}); "
            "'vs levelwise' = levelwise makespan / makespan; '/ bound' = makespan / lower bound"
        )
    else:
        print(f"'vs levelwise' = levelwise makespan / makespan; {res['bound']['source']}")
    if cost is not None:
        print(f"simulated under profile {args.simulate}: nothing ran, so no outputs were checked")
    elif args.warmup == 0:
        print("--warmup 0: the timed runs include each mode's first run, which is cold (marked)")
    written = _write(out, args, w, res, rows, header)
    log.info("wrote %s", ", ".join(str(p) for p in written))
    bad = [r for r in rows if r["check"] is not None and not r["check"]["ok"]]
    if bad:
        from .app import _error

        _error(
            "; ".join(
                f"mode {r['mode']}: output {r['check']['output']} differs from the reference "
                f"(relative error {r['check']['max_rel_err']:.3g} > {r['check']['tol']:.0e})"
                for r in bad
            )
        )
        return 1
    return 0


def _capacity_text(capacity) -> str:
    from disco_ray.graph.sizes import format_size

    if capacity is None:
        return "everything fits"
    caps = capacity if isinstance(capacity, list) else [capacity]
    return ", ".join(format_size(c) for c in caps)


def _header(args, w, res) -> str:
    p = " ".join(f"{k}={v}" for k, v in w.params.items() if k != "file")
    where = (
        f"simulated ({args.simulate})" if args.simulate else f"{args.backend} backend, {args.engine} engine"
    )
    return (
        f"{w.name} {p}".rstrip()
        + f"\ncapacity {_capacity_text(args.capacity)} per GPU; {where}; device: {res['device']}"
    )


# ---- simulated ---------------------------------------------------------------------------------
def _simulated(args, w, modes, cost) -> dict:
    from disco_ray.bench import bound as B
    from disco_ray.bench import modes as M
    from disco_ray.bench import report as bench
    from disco_ray.bench.profiles import UnitCost
    from disco_ray.bench.simulate import simulate
    from disco_ray.graph.trace import chrome_trace

    tg = w.taskgraph
    note = ""
    if isinstance(cost, UnitCost):
        # DISCO §1's worked example: activations X(1) are already on the GPUs, weights cost one unit
        act = {v.id: 0.0 for v in tg.inputs() if v.id not in set(w.weights)}
        cost = UnitCost(
            cost.kernel, cost.load, cost.offload, cost.transfer, cost.launch, cost.streams, act, cost.name
        )
        note = "unit model: activation inputs cost 0 (DISCO §1)"
    unit_model = isinstance(cost, UnitCost)
    ns = 1e6 if unit_model else 1e9  # a unit shows as one millisecond in the trace viewer
    rows, traces = [], {}
    for mode in _bar(modes, "bench"):
        if mode in bench.TORCH_MODES:
            rows.append(bench.row(mode, None, None, None, "not simulated"))
            continue
        mg = M.plan(
            tg, mode, args.capacity, levels=w.levels, order=_order(args, w), host_capacity=args.host_capacity
        )
        r = simulate(mg, tg, cost, streams=args.streams, ahead=args.ahead)
        rows.append(bench.row(mode, r.makespan, bench.sim_summary(mg, r), None, "simulated, not checked"))
        rows[-1]["summary"] = {**bench.sim_summary(mg, r), "plan": mg.statistics()}
        traces[mode] = chrome_trace(mg, bench.sim_records(r, tg.gpus, ns))
        traces[mode]["otherData"] = {
            "mode": mode,
            "makespan_s": r.makespan * ns / 1e9,
            "capacity": mg.capacity,
        }
    kern, load = B.seconds_from_cost(M.in_memory(tg, order=_order(args, w)), tg, cost)
    bound = B.lower_bound(
        kern, load, f"profile {cost.name}: kernel and input-load times of the cost model", note=note
    )
    dev = f"simulated {cost.name}" + (f" ({note})" if note else "")
    return {
        "rows": rows,
        "bound": bound,
        "device": dev,
        "traces": traces,
        "unit": ("units", 1.0) if unit_model else ("ms", 1e3),
        "profile": cost.name,
    }


# ---- measured ----------------------------------------------------------------------------------
def _device_name(backend: str) -> str:
    import torch

    if backend == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--backend cuda: torch sees no CUDA device")
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {os.cpu_count()} cores (cpu backend: arena in host memory, copies are memcpy)"


def _h2d_rate(nbytes: int) -> tuple[float, str]:
    """Bytes/s of a pinned host-to-GPU copy of `nbytes` (best of REPS, after a warm-up)."""
    import torch

    nbytes = max(min(nbytes, 256 << 20), 1 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(REPS + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    rate = nbytes / min(times[1:])  # the best copy: the link's rate without interference
    return rate, f"pinned host -> GPU copy of {nbytes >> 20} MiB, best of {REPS}: {rate / 1e9:.1f} GB/s"


def _to(tensors, dev: str):
    return {k: v.to(dev) for k, v in tensors.items()}


def _cuda_bound(tg, per_mode: dict) -> dict:
    """Kernels timed alone on the GPU and the best H2D rate (`disco_ray.bench.bound`)."""
    from disco_ray.bench import bound as B

    rate, how = _h2d_rate(max((v.nbytes for v in tg.inputs()), default=1))
    seen = max((B.h2d_rate_from_records(mg, recs) for mg, recs in per_mode.values()), default=0.0)
    if seen > rate:
        how += f"; the runs' fastest load copy reached {seen / 1e9:.1f} GB/s, which is used"
        rate = seen
    kern = B.kernel_seconds_alone(tg, "cuda")
    in_b = B.input_bytes(tg)
    src = f"kernel time: each kernel timed alone on the GPU (best of 3), summed per GPU; H2D: input bytes / {how}"
    return B.lower_bound(kern, [b / rate for b in in_b], src, h2d_rate=rate, input_bytes=in_b)


def _measured(args, w, modes) -> dict:
    import torch

    from disco_ray.bench import bound as B
    from disco_ray.bench import modes as M
    from disco_ray.bench import report as bench
    from disco_ray.driver.placement import cluster_kwargs
    from disco_ray.driver.program import Program, RunResult
    from disco_ray.graph.trace import chrome_trace

    from .run import engine_kwargs

    tg = w.taskgraph
    if not w.inputs:
        raise UsageError(f"workload {w.name} was built without inputs (materialize=false); use --simulate")
    device = _device_name(args.backend)
    tdev = "cuda" if args.backend == "cuda" else "cpu"
    with torch.device(tdev):  # the reference makes its own tables (rope) on the device too
        ref = {k: v.cpu() for k, v in w.reference(_to(w.inputs, tdev)).items()}
    if tdev == "cuda":
        torch.cuda.empty_cache()
    tty = sys.stderr.isatty()
    pool = None
    if args.engine == "ray":
        from disco_ray.driver.engine_ray import RayPool

        ck = cluster_kwargs(args)
        pool = RayPool(placement=ck["placement"], address=ck["address"])
    rows, traces, per_mode = [], {}, {}
    ahead = cluster = None
    cold = "cold: the first run" if args.warmup == 0 else ""
    try:
        for mode in _bar(modes, "bench"):
            if mode in bench.TORCH_MODES:
                rows.append(_baseline(mode, w, tdev, ref, args.warmup, args.repeat))
                continue
            mg = M.plan(
                tg,
                mode,
                args.capacity,
                levels=w.levels,
                order=_order(args, w),
                host_capacity=args.host_capacity,
            )
            prog = Program(tg, mg, **engine_kwargs(args), disk_dir=args.disk, pool=pool)
            with prog:
                fastest: RunResult | None = None
                for r in range(args.warmup + args.repeat):  # warm-up: allocator, cuBLAS, actors
                    res = prog.run(w.inputs, timeout=args.timeout, progress=tty, details=True)
                    if r < args.warmup:
                        continue
                    if fastest is None or res.summary["makespan_s"] < fastest.summary["makespan_s"]:
                        fastest = res
                if mode == "dynamic" and args.engine == "ray" and tg.gpus > 1:
                    from disco_ray.driver.cluster import measure_links

                    cluster = measure_links(prog, backend=args.backend)
                workers = prog.statistics()["engine"]["workers"]
                ahead = workers[0]["ahead"]
            assert fastest is not None  # --repeat >= 1 (checked with the options)
            best, recs = fastest.summary, fastest.records
            check = bench.check_outputs(fastest.outputs, ref)
            rows.append(bench.row(mode, best["makespan_s"], best, check, cold if best.get("cold") else ""))
            rows[-1]["summary"] = {**best, "plan": mg.statistics()}
            host = [wk["backend"]["host"] for wk in workers if "host" in wk.get("backend", {})]
            if host:  # cuda: the launchers' host time per vertex, over every run of this mode
                rows[-1]["host"] = host
            per_mode[mode] = (mg, recs)
            traces[mode] = chrome_trace(mg, recs)
            traces[mode]["otherData"] = {"mode": mode, **best, "capacity": mg.capacity}
            if tdev == "cuda":
                torch.cuda.empty_cache()
    finally:
        if pool is not None:
            pool.close()
    bound = _cuda_bound(tg, per_mode) if tdev == "cuda" else B.no_bound()
    return {
        "rows": rows,
        "bound": bound,
        "device": device,
        "traces": traces,
        "cluster": cluster,
        "ahead": ahead,  # the launch ahead the workers used (--ahead, or the backend's default)
    }


def _baseline(mode: str, w, dev: str, ref, warmup: int, repeat: int) -> dict:
    from disco_ray.bench import report as bench
    from workloads.baselines import BASELINES

    fn = BASELINES[mode]
    best = None
    for r in range(warmup + repeat):
        res = fn(w, dev)
        if r < warmup:
            continue
        if best is None or res.seconds < best.seconds:
            best = res
    assert best is not None  # repeat >= 1 (checked with the options)
    check = bench.check_outputs(best.outputs, ref)
    moved = sum(w.taskgraph[x].nbytes for x in w.weights) + sum(
        v.nbytes for v in w.taskgraph.inputs() if v.gpu == 0 and v.id not in set(w.weights)
    )
    note = "; ".join(
        n
        for n in ("one device" if w.taskgraph.gpus > 1 else "", "cold: the first run" if warmup == 0 else "")
        if n
    )
    row = bench.row(mode, best.seconds, None, check, note)
    row["bytes_moved"] = moved  # H2D: all weights and GPU 0's activation inputs
    row["summary"] = {"seconds": best.seconds, "device": best.device}
    return row


# ---- output ------------------------------------------------------------------------------------
def _bar(items, desc):
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="mode", leave=False)
    return items


def _write(out: Path, args, w, res, rows, header: str) -> list[Path]:
    """Writes results.json, timeline.png and the traces (each atomically); returns what it wrote,
    after removing such files an earlier bench left in `out` that this one did not write."""
    from disco_ray.bench import plot
    from disco_ray.graph.formats import write_doc

    unit, _ = res.get("unit", ("ms", 1e3))
    doc = {
        "format": "disco-bench",
        "version": 1,
        "workload": w.name,
        "params": {k: v for k, v in w.params.items() if _plain(v)},
        "capacity": args.capacity,
        "backend": None if args.simulate else args.backend,
        "engine": None if args.simulate else args.engine,
        "streams": args.streams,
        "ahead": res.get("ahead"),
        "order": args.order,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "simulate": args.simulate,
        "profile": res.get("profile"),
        "device": res["device"],
        "time_unit": "units" if unit == "units" else "s",
        "lower_bound": res["bound"],
        "modes": rows,
        "cluster": res.get("cluster"),
        "header": header,
        "argv": sys.argv[1:],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    written = [out / "results.json"]
    write_doc(_jsonable(doc), written[0])
    traces = res["traces"]
    if traces:
        first = "dynamic" if "dynamic" in traces else next(iter(traces))
        for mode, trace in traces.items():
            path = out / ("trace.json" if mode == first else f"trace.{mode}.json")
            write_doc(trace, path)
            written.append(path)
        png, tmp = out / "timeline.png", out / ".timeline.png.tmp.png"
        title = f"{header.splitlines()[0]}\ncapacity {_capacity_text(args.capacity)} per GPU; " + (
            f"simulated ({args.simulate})"
            if args.simulate
            else f"{args.backend} backend, {args.engine} engine"
        )
        plot.plot([plot.panel(t, m) for m, t in traces.items()], str(tmp), title, unit)
        os.replace(tmp, png)
        written.append(png)
    for stale in [out / "timeline.png", out / "trace.json", *out.glob("trace.*.json")]:
        if stale.exists() and stale not in written:
            stale.unlink()
            log.info("removed %s, left by an earlier bench", stale)
    return written


def _plain(v) -> bool:
    return v is None or isinstance(v, (int, float, str, bool))


def _jsonable(x):
    """Floats that JSON can hold (inf/nan as strings), tuples as lists."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if inspect.isclass(x) or callable(x):
        return str(x)
    return x
