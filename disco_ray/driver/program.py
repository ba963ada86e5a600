"""A Program: a planned TaskGraph run many times on the `ray` or `local` engine.

    prog = Program(tg, mg, engine="ray")    # or disco_ray.driver.api.compile(tg, capacity=...)
    out = prog.run(inputs); out2 = prog.run(other_inputs); prog.close()

Outputs are CPU tensors keyed by TaskGraph ids. Inputs are refused before anything runs when one
is missing or has the wrong shape or dtype (`disco_ray.graph.reference.check_inputs`). Any failure
during a run (a kernel raising, a worker dying, the sanitizer firing) raises RunError naming the
worker and the vertex; the Program then tears its engine down (a later run starts a fresh one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias, overload

import torch

from actors.options import RunOptions, WorkerConfig
from disco_ray.graph.errors import GraphError, UsageError
from disco_ray.graph.kernels import missing_kernels
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.reference import check_inputs
from disco_ray.graph.taskgraph import TaskGraph
from disco_ray.graph.trace import summarize, write_trace

if TYPE_CHECKING:
    from .free_memory import CapacityChoice

ENGINES = ("ray", "local")
log = logging.getLogger("disco_ray")
_WARNED: set[str] = set()  # low-precision dtypes already warned about on the cpu backend
Capacity: TypeAlias = int | str | Sequence[int] | Mapping[int, int] | None  # bytes per GPU: see `compile`
RUN_KEYS = ("trace", "details", *RunOptions.__dataclass_fields__)  # what Program.run takes


@dataclass(frozen=True, slots=True)
class RunResult:
    """What `run(..., details=True)` returns: the outputs with the plan and the run's statistics.

    `summary` is `disco_ray.graph.trace.summarize`'s (makespan, per-GPU busy fractions, bytes
    moved by kind, `cold`: the first run of its Program, which pays one-time costs such as
    allocating the arenas and reading sourced inputs); `plan.stats` the planner's (bytes
    offloaded and reloaded, peak bytes, planning time); `records` the trace records per GPU.
    """

    outputs: dict[str, torch.Tensor]
    plan: MemGraph
    summary: dict
    records: list[list]

    def statistics(self) -> dict:
        return {"plan": self.plan.statistics(), "run": self.summary}


def _make_engine(name: str, tg: TaskGraph, mg: MemGraph, **kw):
    if name == "ray":
        from .engine_ray import RayEngine

        return RayEngine(tg, mg, **kw)
    if name == "local":
        from .engine_local import LocalEngine

        return LocalEngine(tg, mg, **kw)
    raise UsageError(f"unknown engine {name!r} (one of {', '.join(ENGINES)})")


class Program:
    """A TaskGraph with its MemGraph; the engine (Ray actors and their arenas) is made on the first run.

    Args:
        tg, mg: the graph and its plan (mg.gpus must equal tg.gpus).
        engine: "ray" (actors; starts a local Ray when none runs) or "local" (threads, one process).
        backend: "cpu" (arena in host memory, streams are threads) or "cuda" once available.
        streams: streams per GPU (TURNIP appendix A uses 5).
        ahead: how many kernels a stream may hold behind the one it runs, launched before their
            predecessors on that GPU finished (the stream waits on them); 0: launch when ready;
            None: the backend's default (cuda 4, cpu 0).
        op_modules: modules the workers import before loading (extra ops, e.g. "actors.testops").
        flush_s: longest a worker holds back a completion report while busy.
        num_cpus: CPUs of a Ray the engine starts (default: all).
        pool: a `RayPool` (ray engine) or `LocalPool` (local engine) to load into and keep: the
            workers, their arenas, resident inputs and states, shared with the pool's other
            Programs (a model's prefill and decode steps); default: a private one, closed with it.
        placement: a `disco_ray.driver.placement.PlacementConfig` (pack/spread, GPU share per worker).
        address: connect to this Ray cluster ("auto", "HOST:PORT") instead of starting a local one.
        sources: inputs read from files (`source`): "host" keeps each in the worker's host memory
            after the first read; "disk" reads it from its file at each load (actors/tiers/diskio.py).
        disk_dir: the directory of the workers' spill files, where a plan offloads to disk (a
            host budget, `compile(host_capacity=...)`); None: a temporary directory each, removed
            when the engine closes.
        trusted: run a plan that did not come from this process's planner without verifying it
            against `tg` first (`planner.verify`); a cycle is refused even then.

    Raises:
        VerifyError: `mg` is not a correct plan of `tg` (the first violations named).
    """

    def __init__(
        self,
        tg: TaskGraph,
        mg: MemGraph,
        *,
        engine: str = "ray",
        backend: str = "cpu",
        streams: int = 5,
        ahead: int | None = None,
        op_modules: Sequence[str] = (),
        flush_s: float = 1e-3,
        num_cpus: int | None = None,
        pool: object | None = None,
        placement: object | None = None,
        address: str | None = None,
        sources: str = "host",
        disk_dir: str | None = None,
        trusted: bool = False,
    ):
        if engine not in ENGINES:
            raise UsageError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
        if mg.gpus != tg.gpus:
            raise GraphError(f"the MemGraph has {mg.gpus} GPUs, the TaskGraph {tg.gpus}")
        missing = [o for o in tg.kept if o not in mg.outputs]
        if missing:
            raise GraphError(f"the MemGraph holds no final vertex for outputs {missing}")
        if mg._planned_for != id(tg):  # a foreign plan: a file, a hand-made or an edited one
            check_plan(tg, mg, trusted)
        missing = missing_kernels(v.op for v in tg if v.op is not None)
        if missing:
            raise UsageError(
                f"op {missing[0]!r} has no kernel: define one with @disco_ray.graph.kernels.impl"
                f'({missing[0]!r}) before running (README, "Your own op")'
            )
        if backend == "cpu":
            _warn_low_precision(tg)
        if pool is not None and type(pool).__name__ != {"ray": "RayPool", "local": "LocalPool"}[engine]:
            raise UsageError(f"a {type(pool).__name__} cannot serve the {engine} engine")
        self.tg, self.mg = tg, mg
        self._callers = tg.caller_inputs()  # what each run's inputs are checked against
        self.engine_name, self.backend, self.streams = engine, backend, streams
        self._kw = {
            "config": WorkerConfig(backend, streams, ahead, flush_s, sources=sources, disk_dir=disk_dir),
            "op_modules": tuple(op_modules),
            "num_cpus": num_cpus,
            "pool": pool,
            "placement": placement,
            "address": address,
        }
        self._engine = None
        self._held: set[str] = set()  # caller inputs the engine's workers keep from earlier runs
        self._plans: dict[tuple[int, ...], MemGraph] = {}  # capacity -> plan (resize)
        self._order: Sequence[str] | None = None  # what compile planned with
        self._alignment = 256
        self._host_capacity: object = None  # what compile planned with (resize keeps it)
        self.capacity_choice: CapacityChoice | None = None  # compile's, for "auto" or "P%"
        self._runs = 0  # runs on the current engine (the first is cold)
        self._summary: dict | None = None
        self._last: tuple | None = None  # (plan, wall s, extra keys) of the last run, summarized when asked
        self.last_records: list[list] | None = None
        self.last_steps: list[list[list]] = []  # each step's records, of the last `run_steps`
        self._entered = 0  # open `with` blocks: a failed run leaves the close to the block's end

    @property
    def engine(self):
        """The engine object (created on first use, and again once its pool's actors were remade):
        LocalEngine or RayEngine."""
        if self._engine is not None and self._engine.stale:
            self.close()
        if self._engine is None:
            self._held = set()
            self._runs = 0
            for m in self._kw["op_modules"]:
                __import__(m)
            log.debug("run: starting the %s engine for %d GPU(s)", self.engine_name, len(self.mg.capacity))
            self._engine = _make_engine(self.engine_name, self.tg, self.mg, **self._kw)
            log.debug("run: the %s engine is up", self.engine_name)
        return self._engine

    @overload
    def run(
        self,
        inputs: Mapping[str, object],
        *,
        trace: str | None = None,
        details: Literal[False] = False,
        **opts,
    ) -> dict[str, torch.Tensor]: ...

    @overload
    def run(
        self, inputs: Mapping[str, object], *, trace: str | None = None, details: Literal[True], **opts
    ) -> RunResult: ...

    @overload
    def run(
        self, inputs: Mapping[str, object], *, trace: str | None = None, details: bool, **opts
    ) -> dict[str, torch.Tensor] | RunResult: ...

    def run(
        self, inputs: Mapping[str, object], *, trace: str | None = None, details: bool = False, **opts
    ) -> dict[str, torch.Tensor] | RunResult:
        """Runs once; returns the outputs keyed by TaskGraph id (with `details`, a `RunResult`:
        the outputs, the plan and the run's statistics).

        Args:
            inputs: a tensor (or numpy array) for every graph input the caller hands in. An input
                given in an earlier run of this Program may be left out: the workers keep their
                copy of it (weights then cross Ray and the host link once; see
                `actors.executor.Executor.begin`). A Program whose workers were remade (after a
                failure) needs every input again.
            check: run the sanitizer (every read checks its writer; see actors/sanitizer.py).
            trace: path of a Chrome/Perfetto trace-event JSON to write.
            delay: debug: sleep uniform(lo, hi) seconds before each vertex (seeded by `seed`),
                so that many execution orders occur.
            timeout: give up (RunError) after this many seconds; None waits for ever.
            progress: True for a tqdm bar, or a callable taking the number of vertices done.
            stall_timeout: ray engine: an actor that leaves a heartbeat unanswered this many
                seconds (10 by default: stopped or hung) ends the run, naming it.
            (check, delay, seed, timeout, progress, stall_timeout are the fields of
            `actors.options.RunOptions`.)

        Raises:
            RunError: a bad input (before anything runs), a kernel that raised, a dead worker,
                the sanitizer, or the timeout.
        """
        alive = self._engine is not None and not self._engine.stale
        check_inputs(self.tg, inputs, self._held if alive else (), self._callers)
        tensors = {k: torch.as_tensor(v) for k, v in inputs.items()}
        bar = None
        progress = opts.pop("progress", None)
        if progress is True:
            from tqdm import tqdm

            bar = tqdm(total=len(self.mg), unit="v", desc="run", leave=False)
            progress = lambda n: bar.update(n - bar.n)  # noqa: E731
        eng = self.engine
        t = time.perf_counter()
        try:
            outs, records = eng.run(tensors, RunOptions(**opts, progress=progress or None))
        except BaseException:
            if not self._entered:  # else the `with` block's end closes it (after its error is told)
                self.close()
            raise
        finally:
            if bar is not None:
                bar.close()
        self._held |= set(tensors)
        self._ran(eng, records, time.perf_counter() - t)
        if trace:
            write_trace(trace, self.mg, records, self.last_summary)
        if details:
            return RunResult(outs, self.mg, self.last_summary or {}, records)
        return outs

    def _ran(self, eng, records: list[list], wall: float) -> None:
        """Keeps a run's records and what its summary adds to them (made when asked)."""
        self.last_records = records
        extra: dict = {
            "cold": self._runs == 0,  # the engine's first run: arenas, sourced inputs
            "transports": dict(getattr(eng, "transports", {})),  # "i-j" -> path
            "transport_fallbacks": dict(getattr(eng, "fallbacks", {})),  # "i-j" -> why on the object store
        }
        if any(self.mg.disk_capacity):  # the spill files' I/O: bytes, seconds, bandwidth per worker
            extra["disk"] = disk_summary(eng.statistics()["workers"])
        if getattr(eng, "placement_summary", None) is not None:  # ray engine: node of each worker, paths
            extra["placement"] = eng.placement_summary
        # the records are summarized when asked (`last_summary`): a decode step does not pay for it
        self._last, self._summary = (self.mg, wall, extra), None
        self._runs += 1

    def run_steps(
        self,
        feeds: Sequence[Mapping[str, object]],
        *,
        carry: Mapping[str, str | Sequence[str]],
        halt: str | Sequence[str] = (),
        on_step: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        **opts,
    ) -> list[dict[str, torch.Tensor]]:
        """Runs the plan up to len(feeds) times, step k on `feeds[k]` and the outputs of step k-1
        that `carry` names; returns each step's outputs ("Several steps per call", RUNTIME.md).

        Args:
            feeds: step k's inputs, as `run` takes them; a step after the first leaves out the
                carried inputs, and may leave out any input an earlier step or run handed in.
            carry: output -> the input (or inputs) of the next step it becomes (same shape, dtype).
            halt: outputs ending the call after the first step where one holds a nonzero element.
            on_step: called with (k, step k's outputs) as step k ends, while the later ones run.
            opts: `check`, `delay`, `seed`, `timeout` (the whole call's), `progress`, as `run`'s.

        `last_records`, `last_summary`: the last step's (wall: the call's / steps); `last_steps`:
        every step's records. UsageError: a carry or halt that is no output, or misshapen."""
        from .steps import check_steps

        carried, halts = check_steps(self.tg, feeds, carry, halt, self.held, self._callers)
        tensors = [{k: torch.as_tensor(v) for k, v in feed.items()} for feed in feeds]
        eng = self.engine
        t = time.perf_counter()
        try:
            outs, steps = eng.run_steps(tensors, carried, halts, RunOptions(**opts), on_step)
        except BaseException:
            if not self._entered:  # else the `with` block's end closes it (after its error is told)
                self.close()
            raise
        self._held |= {k for feed in tensors for k in feed} | {x for xs in carried.values() for x in xs}
        self.last_steps = steps
        self._ran(eng, steps[-1], (time.perf_counter() - t) / len(steps))
        return outs

    @property
    def last_summary(self) -> dict | None:
        """The last run's statistics (`disco_ray.graph.trace.summarize` of its records, and `cold`:
        the engine's first run, the transports, the disk tier's I/O, the placement); None before
        the first run."""
        if self._summary is None and self._last is not None and self.last_records is not None:
            mg, wall, extra = self._last
            self._summary = {**summarize(mg, self.last_records, wall), **extra}
        return self._summary

    @property
    def held(self) -> frozenset[str]:
        """The caller inputs the workers keep from earlier runs (a run may leave them out)."""
        alive = self._engine is not None and not self._engine.stale
        return frozenset(self._held) if alive else frozenset()

    def statistics(self) -> dict:
        out = {"memgraph": self.mg.statistics(), "last_run": self.last_summary}
        if self.capacity_choice is not None:
            out["capacity_choice"] = self.capacity_choice.statistics()
        if self._engine is not None:
            out["engine"] = self._engine.statistics()
        return out

    def resize(self, capacity: int | str | Sequence[int]) -> dict:
        """Runs within `capacity` arena bytes per GPU from the next run on (elastic capacity):
        the engine is closed, which frees the arenas (the memory goes back to the device), and
        the graph is planned again for the new capacity (plans are kept per capacity; the order
        and alignment are those it was compiled with). Returns the seconds to free and to plan."""
        from disco_ray.graph.sizes import parse_capacity
        from planner import build_memgraph
        from planner.capacity import capacities

        t0 = time.perf_counter()
        self.close()
        t1 = time.perf_counter()
        caps = tuple(
            capacities(parse_capacity(capacity) if isinstance(capacity, str) else capacity, self.tg.gpus)
        )
        self._plans.setdefault(tuple(self.mg.capacity), self.mg)
        mg = self._plans.get(caps)
        if mg is None:
            mg = self._plans[caps] = build_memgraph(
                self.tg,
                list(caps),
                order=self._order,
                alignment=self._alignment,
                host_capacity=self._host_capacity,  # type: ignore[arg-type]
            )
        self.mg = mg
        return {"capacity": list(caps), "free_s": t1 - t0, "plan_s": time.perf_counter() - t1}

    def close(self) -> None:
        """Kills the engine's actors (and the Ray it started); the Program stays usable."""
        self._held = set()
        if self._engine is not None:
            eng, self._engine = self._engine, None
            eng.close()

    def __enter__(self) -> Program:
        self._entered += 1
        return self

    def __exit__(self, *exc) -> None:
        self._entered -= 1
        self.close()


def disk_summary(workers: Sequence[dict]) -> dict:
    """The run's spill-file I/O from the workers' statistics: per worker and in all (GB/s: bytes
    over the seconds of file I/O, summed over workers)."""
    per = [{"gpu": w.get("gpu", g), **w["disk"]} for g, w in enumerate(workers) if w.get("disk")]
    out: dict = {"workers": per}
    for way, secs in (("written", "write_s"), ("read", "read_s")):
        b = sum(w[f"bytes_{way}"] for w in per)
        t = sum(w[secs] for w in per)
        out[f"bytes_{way}"] = b
        out[secs] = round(t, 6)
        out[f"{'write' if way == 'written' else 'read'}_gb_per_s"] = round(b / t / 1e9, 3) if t else None
    return out


def check_plan(tg: TaskGraph, mg: MemGraph, trusted: bool = False) -> None:
    """Refuses (VerifyError) a plan that is not correct for `tg`, before anything starts: a cycle
    always (the runtime would wait for ever), every other FORMATS.md condition (sum-into groups
    included) unless `trusted`."""
    from planner.verify import check, check_acyclic

    check_acyclic(mg)
    if not trusted:
        check(tg, mg, limit=3)


def _warn_low_precision(tg: TaskGraph) -> None:
    """Once per dtype and process: float16/bfloat16 kernels on the cpu backend are slow."""
    slow = sorted({v.dtype for v in tg if v.op is not None and v.dtype in ("float16", "bfloat16")} - _WARNED)
    if slow:
        _WARNED.update(slow)
        log.warning(
            "%s kernels on the cpu backend are slow: most CPUs have no fast %s arithmetic, so they "
            "can take many times as long as float32 (time them on a GPU; use float32 to try plans on a CPU)",
            " and ".join(slow),
            "/".join(slow),
        )
