"""`disco-ray bench`: run one workload in several modes on one memory budget and compare them.

    disco-ray bench WORKLOAD [key=value ...] --capacity SIZE
        [--modes dynamic,deterministic,levelwise,in_memory,torch_naive,torch_prefetch]
        [--backend cpu|cuda] [--engine ray|local] [--simulate PROFILE] [--repeat N] [--out DIR]
        [--address auto|ADDR]

Every mode runs the same workload (same inputs) and, for the runtime modes, the same capacity.
Each mode's outputs are checked against the workload's own torch reference (tolerance by dtype,
`disco_ray.bench.report.TOLERANCE`); a mismatch fails the command (exit 1) naming the mode, after the
table is printed. With --simulate PROFILE the runtime modes are simulated under that device
profile instead (nothing runs, so nothing is checked; torch baselines are not simulated).

Written to DIR: results.json (every figure, the device/backend/profile, per-mode summaries and,
on Ray with several workers, per-node and per-link figures), timeline.png (compute / H2D / D2H
lanes of each GPU over time, dynamic vs levelwise, as in DISCO Figures 2-3) and trace.json
(Chrome trace of the dynamic run).
"""

from __future__ import annotations

import inspect
import os
import platform
import sys
import time
from pathlib import Path

from disco_ray.graph.errors import UsageError

REPS = 9  # timed copies of the H2D probe


def add_bench(sub) -> None:
    from disco_ray.driver.placement import add_cluster_args

    from .run import add_capacity_arg, add_engine_args

    p = sub.add_parser(
        "bench",
        help="compare execution modes and torch baselines on one workload",
        description="Run WORKLOAD in each mode on the same memory budget; check outputs; print a table; "
        "write results.json, timeline.png and trace.json to --out.",
    )
    p.add_argument("workload", metavar="WORKLOAD", help="workload name (disco-ray workload --list)")
    p.add_argument("params", nargs="*", metavar="key=value", help="workload parameters, e.g. n=8 gpus=2")
    add_capacity_arg(p)
    p.add_argument(
        "--modes",
        default="dynamic,deterministic,levelwise,in_memory,torch_naive,torch_prefetch",
        help="comma-separated modes (also torch_in_memory)",
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
    p.add_argument("--timeout", type=float, metavar="S", help="give up a run after S seconds")
    add_cluster_args(p)  # --address, --placement, --gpus-per-worker, --cpus-per-worker


def _workload(args, simulate: bool):
    import workloads

    from .workload import parse_params

    kv = parse_params(args.params)
    if simulate and "materialize" in workloads.params(args.workload):
        kv.setdefault("materialize", "false")  # a simulation needs no tensors
    return workloads.build_from_strings(args.workload, kv)


def _order(args, w) -> list[str] | None:
    """The builder's serial order (`Workload.order`), or None for the planner's default."""
    return w.order() if args.order == "builder" else None


def cmd_bench(args) -> int:
    from disco_ray.bench import report as bench

    try:
        modes = bench.parse_modes(args.modes)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from .run import engine_kwargs

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
    w = _workload(args, cost is not None)
    if "levelwise" in modes and not w.levels:
        raise UsageError(f"workload {w.name} has no levels: mode levelwise cannot run")
    torch_modes = [m for m in modes if m in bench.TORCH_MODES]
    if torch_modes and cost is None and w.name not in ("matmul_chain", "llama_prefill"):
        raise UsageError(f"no torch baseline for workload {w.name} (modes {', '.join(torch_modes)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if cost is not None:
        res = _simulated(args, w, modes, cost)
    else:
        res = _measured(args, w, modes)
    rows = bench.finish_rows(res["rows"], res["bound"]["seconds"])
    unit, scale = res.get("unit", ("ms", 1e3))
    header = _header(args, w, res)
    table = bench.format_table(rows, unit, scale)
    print(header)
    print(table)
    print(
        f"lower bound {res['bound']['seconds'] * scale:.4g} {unit} ({res['bound']['source']}); "
        "'vs levelwise' = levelwise makespan / makespan; '/ bound' = makespan / lower bound"
    )
    if cost is not None:
        print(f"simulated under profile {args.simulate}: nothing ran, so no outputs were checked")
    _write(out, args, w, res, rows, header)
    print(f"wrote {out / 'results.json'}, {out / 'timeline.png'}, {out / 'trace.json'}", file=sys.stderr)
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


def _header(args, w, res) -> str:
    from disco_ray.graph.sizes import format_size

    caps = args.capacity if isinstance(args.capacity, list) else [args.capacity]
    cap = "everything fits" if args.capacity is None else ", ".join(format_size(c) for c in caps)
    p = " ".join(f"{k}={v}" for k, v in w.params.items())
    where = (
        f"simulated ({args.simulate})" if args.simulate else f"{args.backend} backend, {args.engine} engine"
    )
    return f"{w.name} {p}\ncapacity {cap} per GPU; {where}; device: {res['device']}"


# ---- simulated ---------------------------------------------------------------------------------
def _simulated(args, w, modes, cost) -> dict:
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
    rows, results, plans = [], {}, {}
    for mode in _bar(modes, "bench"):
        if mode in bench.TORCH_MODES:
            rows.append(bench.row(mode, None, None, None, "not simulated"))
            continue
        mg = M.plan(tg, mode, args.capacity, levels=w.levels, order=_order(args, w))
        r = simulate(mg, tg, cost, streams=args.streams)
        results[mode], plans[mode] = r, mg
        rows.append(bench.row(mode, r.makespan, bench.sim_summary(mg, r), None, "simulated, not checked"))
        rows[-1]["summary"] = {**bench.sim_summary(mg, r), "plan": mg.statistics()}
    kern, load = bench.seconds_from_cost(M.in_memory(tg, order=_order(args, w)), tg, cost)
    unit_model = isinstance(cost, UnitCost)
    bound = bench.lower_bound(
        kern, load, f"profile {cost.name}: kernel and input-load times of the cost model", note=note
    )
    trace = None
    if "dynamic" in results:
        ns = 1e6 if unit_model else 1e9  # a unit shows as one millisecond in the trace viewer
        trace = chrome_trace(plans["dynamic"], bench.sim_records(results["dynamic"], tg.gpus, ns))
    dev = f"simulated {cost.name}" + (f" ({note})" if note else "")
    return {
        "rows": rows,
        "bound": bound,
        "device": dev,
        "timelines": {m: results[m] for m in ("dynamic", "levelwise") if m in results},
        "trace": trace,
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


def _h2d_rate(nbytes: int, backend: str) -> tuple[float, str]:
    """Bytes/s of a host-to-arena copy of `nbytes` on the backend (best of REPS, after a warm-up)."""
    import torch

    nbytes = max(min(nbytes, 256 << 20), 1 << 20)
    if backend == "cuda":
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
        how = "pinned host -> GPU copy"
    else:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(REPS + 1):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        how = "host memcpy (the cpu backend's H2D)"
    rate = nbytes / min(times[1:])  # the best copy: the link's rate without interference
    return rate, f"{how} of {nbytes >> 20} MiB, best of {REPS}: {rate / 1e9:.1f} GB/s"


def _to(tensors, dev: str):
    return {k: v.to(dev) for k, v in tensors.items()}


def _measured(args, w, modes) -> dict:
    import torch

    from disco_ray.bench import modes as M
    from disco_ray.bench import report as bench
    from disco_ray.driver.placement import cluster_kwargs
    from disco_ray.driver.program import Program

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
    # before anything else runs, so that the probe has the machine to itself
    rate, how = _h2d_rate(max((v.nbytes for v in tg.inputs()), default=1), args.backend)
    tty = sys.stderr.isatty()
    pool, kw = None, {}
    if args.engine == "ray":
        from disco_ray.driver.engine_ray import RayPool

        ck = cluster_kwargs(args)
        pool = RayPool(placement=ck["placement"], address=ck["address"])
        kw = {"pool": pool}
    rows, timelines, per_mode = [], {}, {}
    ahead = None
    trace = cluster = None
    try:
        for mode in _bar(modes, "bench"):
            if mode in bench.TORCH_MODES:
                rows.append(_baseline(mode, w, tdev, ref, args.warmup, args.repeat))
                continue
            mg = M.plan(tg, mode, args.capacity, levels=w.levels, order=_order(args, w))
            prog = Program(tg, mg, **engine_kwargs(args), **kw)
            with prog:
                best = recs = outs = None
                for r in range(args.warmup + args.repeat):  # warm-up: allocator, cuBLAS, actors
                    o = prog.run(w.inputs, timeout=args.timeout, progress=tty)
                    s = prog.last_summary
                    if r < args.warmup:
                        continue
                    if best is None or s["makespan_s"] < best["makespan_s"]:
                        best, recs, outs = s, prog.last_records, o
                if mode == "dynamic" and args.engine == "ray" and tg.gpus > 1:
                    from disco_ray.driver.cluster import measure_links

                    cluster = measure_links(prog, backend=args.backend)
                workers = prog.statistics()["engine"]["workers"]
                ahead = workers[0]["ahead"]
            check = bench.check_outputs(outs, ref)
            rows.append(bench.row(mode, best["makespan_s"], best, check))
            rows[-1]["summary"] = {**best, "plan": mg.statistics()}
            host = [wk["backend"]["host"] for wk in workers if "host" in wk.get("backend", {})]
            if host:  # cuda: the launchers' host time per vertex, over every run of this mode
                rows[-1]["host"] = host
            per_mode[mode] = (mg, recs)
            if mode in ("dynamic", "levelwise"):
                timelines[mode] = bench.timeline_from_records(mg, recs, mode)
            if mode == "dynamic":
                from disco_ray.graph.trace import chrome_trace

                trace = chrome_trace(mg, recs)
                trace["otherData"] = best
            if tdev == "cuda":
                torch.cuda.empty_cache()
    finally:
        if pool is not None:
            pool.close()
    base = "in_memory" if "in_memory" in per_mode else next(iter(per_mode), None)
    kern = bench.kernel_seconds_from_records(*per_mode[base]) if base else [0.0] * tg.gpus
    in_b = bench.input_bytes(tg)
    seen = max((bench.h2d_rate_from_records(mg, recs) for mg, recs in per_mode.values()), default=0.0)
    if seen > rate:
        how += f"; the runs' fastest load copy reached {seen / 1e9:.1f} GB/s, which is used"
        rate = seen
    src = f"kernel time: union of kernel intervals of the {base} run; H2D: input bytes / {how}"
    if base is None:
        src = f"no runtime mode ran, kernel time unknown (0); H2D: input bytes / {how}"
    bound = bench.lower_bound(kern, [b / rate for b in in_b], src, h2d_rate=rate, input_bytes=in_b)
    return {
        "rows": rows,
        "bound": bound,
        "device": device,
        "timelines": timelines,
        "trace": trace,
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
    check = bench.check_outputs(best.outputs, ref)
    moved = sum(w.taskgraph[x].nbytes for x in w.weights) + sum(
        v.nbytes for v in w.taskgraph.inputs() if v.gpu == 0 and v.id not in set(w.weights)
    )
    note = "one device" if w.taskgraph.gpus > 1 else ""
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


def _write(out: Path, args, w, res, rows, header: str) -> None:
    from disco_ray.bench import report as bench
    from disco_ray.graph.formats import write_doc

    unit, scale = res.get("unit", ("ms", 1e3))
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
    write_doc(_jsonable(doc), out / "results.json")
    png = out / "timeline.png"
    tmp = out / ".timeline.png.tmp.png"
    if res["timelines"]:
        bench.plot_timelines(res["timelines"], str(tmp), unit, scale)
        os.replace(tmp, png)
    if res["trace"] is not None:
        write_doc(res["trace"], out / "trace.json")


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
