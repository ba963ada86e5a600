"""`bench(workload, settings)`: one workload in several modes on one memory budget, compared.

What `disco-ray bench` runs, callable from Python with plain arguments:

    w = workloads.build("matmul_chain", n=4, gpus=2, tokens=16, hidden=64)
    res = bench(w, BenchSettings(capacity=24 << 10, engine="local", modes=("dynamic", "levelwise")))
    print(res.rows[0]["makespan_s"], res.mismatches())

Every mode runs the same graph (same inputs) and, for the runtime modes, the same capacity; each
mode's outputs are checked against the workload's reference (`report.check_outputs`). With
`simulate=PROFILE` the runtime modes are simulated under that device profile instead (nothing
runs, so nothing is checked). `disco_ray.bench.output` writes the result's files.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from disco_ray.driver.placement import PlacementConfig
from disco_ray.graph.errors import UsageError

from . import report

REPS = 9  # timed copies of the H2D probe
BASELINE_WORKLOADS = ("matmul_chain", "llama_prefill")  # workloads.baselines knows these
ORDERS = ("planner", "builder")


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """How `bench` runs a workload: the `disco-ray bench` options, as plain values."""

    # modes to run, in order (report.ALL_MODES); None: every one that applies (levelwise where the
    # workload has levels, the torch baselines where it has one and nothing is simulated)
    modes: tuple[str, ...] | None = None
    # arena bytes of every GPU, or one per GPU; None: room for everything
    capacity: int | Sequence[int] | None = None
    # host-store bytes per GPU beyond which offloads go to disk; None: unbounded
    host_capacity: int | Sequence[int] | None = None
    # serial order to plan in: the planner's own ("planner") or the workload builder's ("builder")
    order: str = "planner"
    engine: str = "ray"  # "ray" or "local"
    backend: str = "cpu"  # "cpu" or "cuda"
    streams: int = 5  # streams per GPU
    ahead: int | None = None  # kernels a stream may hold launched; None: the backend's default
    simulate: str | None = None  # a device profile (profiles.get) to simulate under; None: run
    repeat: int = 1  # timed runs per mode; the fastest counts
    warmup: int = 1  # untimed runs per mode before the timed ones
    timeout: float | None = None  # seconds before a run is given up; None: no limit
    disk_dir: str | None = None  # the workers' spill files; None: a temporary directory
    address: str | None = None  # ray engine: a running cluster to use; None: a local Ray
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # ray engine: the workers'

    def validate(self) -> None:
        """UsageError for a setting no run can have (an unknown mode or profile, no timed run)."""
        if self.repeat < 1 or self.warmup < 0:
            raise UsageError(f"repeat must be >= 1 and warmup >= 0, got {self.repeat}, {self.warmup}")
        if self.order not in ORDERS:
            raise UsageError(f"unknown order {self.order!r} (one of {', '.join(ORDERS)})")
        if self.simulate is not None:
            self.cost()
        if self.modes is not None:
            try:
                report.parse_modes(",".join(self.modes))
            except ValueError as e:
                raise UsageError(str(e)) from None
        self.placement.validate()

    def cost(self):
        """The device profile of `simulate` (None when the modes run); UsageError for an unknown one."""
        from . import profiles

        if self.simulate is None:
            return None
        try:
            return profiles.get(self.simulate)
        except ValueError as e:
            raise UsageError(str(e)) from None


@dataclass(frozen=True, slots=True)
class BenchResult:
    """What `bench` measured (or simulated): a row per mode, the lower bound and the traces."""

    # a row per mode (report.row + report.finish_rows): makespan_s, speedup_vs_levelwise,
    # vs_bound, busy_compute, bytes_moved, check (None where nothing was checked), note, summary
    rows: list[dict]
    bound: dict  # the lower bound (bound.lower_bound, or bound.no_bound with the reason)
    device: str  # the device it ran on, or the profile it was simulated under
    traces: dict[str, dict]  # runtime mode -> its Chrome trace (the fastest run's)
    unit: tuple[str, float] = ("ms", 1e3)  # the table's time unit and its seconds -> unit scale
    profile: str | None = None  # the profile simulated under
    cluster: dict | None = None  # ray engine, several workers: per-node and per-link figures
    ahead: int | None = None  # the launch ahead the workers used (settings.ahead, or the default)

    def mismatches(self) -> list[dict]:
        """The rows whose outputs differ from the reference."""
        return [r for r in self.rows if r["check"] is not None and not r["check"]["ok"]]


def bench(w, settings: BenchSettings) -> BenchResult:
    """Runs (or simulates) `w`, a `workloads.Workload`, in each mode of `settings`.

    Raises:
        UsageError: a setting no run can have, a mode that cannot run on `w`, a workload built
            without inputs that is not simulated.
    """
    settings.validate()
    cost = settings.cost()
    modes = select_modes(w, settings)
    if cost is not None:
        res = _simulated(w, settings, modes, cost)
    else:
        res = _measured(w, settings, modes)
    report.finish_rows(res.rows, res.bound["seconds"])
    return res


def select_modes(w, settings: BenchSettings) -> list[str]:
    """The modes asked for, or every one that applies; UsageError for one that cannot run on `w`."""
    simulated = settings.simulate is not None
    baseline = w.name in BASELINE_WORKLOADS and "file" not in w.params
    if settings.modes is None:
        modes = [m for m in report.RUNTIME_MODES if m != "levelwise" or w.levels]
        if baseline and not simulated:
            modes += ["torch_naive", "torch_prefetch"]
        return modes
    try:
        modes = report.parse_modes(",".join(settings.modes))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if "levelwise" in modes and not w.levels:
        raise UsageError(f"workload {w.name} has no levels: mode levelwise cannot run")
    torch_modes = [m for m in modes if m in report.TORCH_MODES]
    if torch_modes and not simulated and not baseline:
        raise UsageError(f"no torch baseline for workload {w.name} (modes {', '.join(torch_modes)})")
    return modes


def _order(w, settings: BenchSettings) -> list[str] | None:
    """The builder's serial order (`Workload.order`), or None for the planner's default."""
    return w.order() if settings.order == "builder" else None


def _plan(w, settings: BenchSettings, mode: str):
    from . import modes as M

    return M.plan(
        w.taskgraph,
        mode,
        settings.capacity,
        levels=w.levels,
        order=_order(w, settings),
        host_capacity=settings.host_capacity,
    )


def _bar(items):
    """`items`, drawn as a progress bar when stderr is a terminal."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(items, desc="bench", unit="mode", leave=False)
    return items


# ---- simulated ---------------------------------------------------------------------------------
def _simulated(w, settings: BenchSettings, modes: list[str], cost) -> BenchResult:
    from disco_ray.graph.trace import chrome_trace

    from . import bound as B
    from . import modes as M
    from .profiles import UnitCost
    from .simulate import simulate

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
    for mode in _bar(modes):
        if mode in report.TORCH_MODES:
            rows.append(report.row(mode, None, None, None, "not simulated"))
            continue
        mg = _plan(w, settings, mode)
        r = simulate(mg, tg, cost, streams=settings.streams, ahead=settings.ahead)
        rows.append(report.row(mode, r.makespan, report.sim_summary(mg, r), None, "simulated, not checked"))
        rows[-1]["summary"] = {**report.sim_summary(mg, r), "plan": mg.statistics()}
        traces[mode] = chrome_trace(mg, report.sim_records(r, tg.gpus, ns))
        traces[mode]["otherData"] = {
            "mode": mode,
            "makespan_s": r.makespan * ns / 1e9,
            "capacity": mg.capacity,
        }
    kern, load = B.seconds_from_cost(M.in_memory(tg, order=_order(w, settings)), tg, cost)
    bound = B.lower_bound(
        kern, load, f"profile {cost.name}: kernel and input-load times of the cost model", note=note
    )
    return BenchResult(
        rows,
        bound,
        f"simulated {cost.name}" + (f" ({note})" if note else ""),
        traces,
        unit=("units", 1.0) if unit_model else ("ms", 1e3),
        profile=cost.name,
    )


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


def _cuda_bound(tg, per_mode: dict) -> dict:
    """Kernels timed alone on the GPU and the best H2D rate (`disco_ray.bench.bound`)."""
    from . import bound as B

    rate, how = _h2d_rate(max((v.nbytes for v in tg.inputs()), default=1))
    seen = max((B.h2d_rate_from_records(mg, recs) for mg, recs in per_mode.values()), default=0.0)
    if seen > rate:
        how += f"; the runs' fastest load copy reached {seen / 1e9:.1f} GB/s, which is used"
        rate = seen
    kern = B.kernel_seconds_alone(tg, "cuda")
    in_b = B.input_bytes(tg)
    src = f"kernel time: each kernel timed alone on the GPU (best of 3), summed per GPU; H2D: input bytes / {how}"
    return B.lower_bound(kern, [b / rate for b in in_b], src, h2d_rate=rate, input_bytes=in_b)


def _reference(w, tdev: str) -> dict:
    """The workload's reference outputs, computed on `tdev`, on the CPU."""
    import torch

    with torch.device(tdev):  # the reference makes its own tables (rope) on the device too
        ref = {k: v.cpu() for k, v in w.reference({k: v.to(tdev) for k, v in w.inputs.items()}).items()}
    if tdev == "cuda":
        torch.cuda.empty_cache()
    return ref


def _measured(w, settings: BenchSettings, modes: list[str]) -> BenchResult:
    import torch

    from . import bound as B

    if not w.inputs:
        raise UsageError(f"workload {w.name} was built without inputs (materialize=false); use --simulate")
    device = _device_name(settings.backend)
    tdev = "cuda" if settings.backend == "cuda" else "cpu"
    ref = _reference(w, tdev)
    pool = None
    if settings.engine == "ray":
        from disco_ray.driver.pool import RayPool

        pool = RayPool(placement=settings.placement, address=settings.address)
    rows, traces, per_mode = [], {}, {}
    ahead = cluster = None
    try:
        for mode in _bar(modes):
            if mode in report.TORCH_MODES:
                rows.append(_baseline(mode, w, tdev, ref, settings.warmup, settings.repeat))
                continue
            mg = _plan(w, settings, mode)
            fastest, workers, links = _run_mode(w, settings, mg, pool, mode)
            if links is not None:
                cluster = links
            ahead = workers[0]["ahead"]
            rows.append(_measured_row(mode, mg, fastest, ref, workers, settings.warmup))
            per_mode[mode] = (mg, fastest.records)
            traces[mode] = _trace(mg, fastest, mode)
            if tdev == "cuda":
                torch.cuda.empty_cache()
    finally:
        if pool is not None:
            pool.close()
    bound = _cuda_bound(w.taskgraph, per_mode) if tdev == "cuda" else B.no_bound()
    return BenchResult(rows, bound, device, traces, cluster=cluster, ahead=ahead)


def _run_mode(w, settings: BenchSettings, mg, pool, mode: str):
    """Runs `mg` warmup + repeat times on one Program; returns the fastest timed run, the workers'
    statistics and, for the dynamic mode on Ray with several workers, the links measured."""
    from disco_ray.driver.program import Program, RunResult

    tg = w.taskgraph
    tty = sys.stderr.isatty()
    cluster = None
    with Program(
        tg,
        mg,
        engine=settings.engine,
        backend=settings.backend,
        streams=settings.streams,
        ahead=settings.ahead,
        disk_dir=settings.disk_dir,
        pool=pool,
    ) as prog:
        fastest: RunResult | None = None
        for r in range(settings.warmup + settings.repeat):  # warm-up: allocator, cuBLAS, actors
            res = prog.run(w.inputs, timeout=settings.timeout, progress=tty, details=True)
            if r < settings.warmup:
                continue
            if fastest is None or res.summary["makespan_s"] < fastest.summary["makespan_s"]:
                fastest = res
        if mode == "dynamic" and settings.engine == "ray" and tg.gpus > 1:
            from disco_ray.driver.cluster import measure_links

            cluster = measure_links(prog, backend=settings.backend)
        workers = prog.statistics()["engine"]["workers"]
    assert fastest is not None  # repeat >= 1 (BenchSettings.validate)
    return fastest, workers, cluster


def _measured_row(mode: str, mg, fastest, ref: dict, workers: list[dict], warmup: int) -> dict:
    """A runtime mode's row: its fastest run's figures, its outputs checked against `ref`."""
    best = fastest.summary
    check = report.check_outputs(fastest.outputs, ref)
    cold = "cold: the first run" if warmup == 0 and best.get("cold") else ""
    row = report.row(mode, best["makespan_s"], best, check, cold)
    row["summary"] = {**best, "plan": mg.statistics()}
    host = [wk["backend"]["host"] for wk in workers if "host" in wk.get("backend", {})]
    if host:  # cuda: the launchers' host time per vertex, over every run of this mode
        row["host"] = host
    return row


def _trace(mg, run, mode: str) -> dict:
    """The Chrome trace of a measured run, with the mode, its summary and the plan's capacity."""
    from disco_ray.graph.trace import chrome_trace

    trace = chrome_trace(mg, run.records)
    trace["otherData"] = {"mode": mode, **run.summary, "capacity": mg.capacity}
    return trace


def _baseline(mode: str, w, dev: str, ref, warmup: int, repeat: int) -> dict:
    from workloads.baselines import BASELINES

    fn = BASELINES[mode]
    best = None
    for r in range(warmup + repeat):
        res = fn(w, dev)
        if r < warmup:
            continue
        if best is None or res.seconds < best.seconds:
            best = res
    assert best is not None  # repeat >= 1 (BenchSettings.validate)
    check = report.check_outputs(best.outputs, ref)
    moved = sum(w.taskgraph[x].nbytes for x in w.weights) + sum(
        v.nbytes for v in w.taskgraph.inputs() if v.gpu == 0 and v.id not in set(w.weights)
    )
    note = "; ".join(
        n
        for n in ("one device" if w.taskgraph.gpus > 1 else "", "cold: the first run" if warmup == 0 else "")
        if n
    )
    row = report.row(mode, best.seconds, None, check, note)
    row["bytes_moved"] = moved  # H2D: all weights and GPU 0's activation inputs
    row["summary"] = {"seconds": best.seconds, "device": best.device}
    return row
