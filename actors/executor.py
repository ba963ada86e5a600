"""One GPU worker's execution engine: arena, host store, streams, local counters, batched reports.

Shared by the Ray actor shell (`actors.worker.GpuWorker`) and the local engine. Everything is
allocated in `__init__` (arena, host store, a torch view per vertex operand: `actors.resources`;
stream threads); a run only issues copies and kernels on those views (TURNIP section 5: no allocation while a graph
runs; the host-side copy a Ray transfer returns is the one exception, see `read_range`). What it
calls on its backend, transport and spill tier is their contract (`actors.backends.base`,
`actors.transports.base`, `actors.tiers.base`).

Launch path (hot): a completion, in the thread that found it, updates the local counters
(`actors.worker_core.WorkerCore`) under one lock, and `StreamSlots` (`actors.slots`) picks what to start on which
stream: a ready kernel on a free compute stream, a ready copy on its lane (loads, offloads, the
transfers from each peer: a copy never waits for a compute stream), or with launch ahead
(`ahead` > 0) a kernel behind its running predecessors, which the backend starts once they are
done (CUDA: the stream waits on their events; cpu: the stream thread waits), so on a GPU the
host prepares the next kernels of a chain while the current one runs. Launch ahead is off while
the sanitizer runs on a backend that launches asynchronously (its checks run at launch). The
completion goes to the reporter (`actors.reporter`), which batches completions for the
coordinator with a bounded lag.

Streams of a worker: 0..S-1 compute, then the copy lanes (`actors.lanes`); disk I/O runs aside
(BLOCKING) on cuda.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .backends.base import Backend, Mode
from .carries import CarrySaves
from .conditions import Conditions
from .options import DEFAULT_WORKER, WorkerConfig
from .plans import PlanKind, describe
from .reporter import ReportThread
from .sanitizer import Sanitizer
from .tiers.store import WorkerStore
from .transports.base import Transport
from .work import InUnit, VertexWork

DRAIN_S = 10.0  # how long a run waits for the vertices a failed run had launched to land
Report = Callable[[int, list[int]], None]  # (gpu, completed vids)
Fail = Callable[[int, int | None, str], None]  # (gpu, vid, message)


class Executor(VertexWork):
    """The vertices of GPU `gpu` of `mg`; `begin` starts a run, `dispatch` feeds it, `wait` ends it."""

    def __init__(
        self,
        gpu: int,
        mg: MemGraph,
        tg: TaskGraph,
        config: WorkerConfig = DEFAULT_WORKER,
        *,
        backend: Backend | None = None,
        transport: Transport | None = None,
        report: Report | None = None,
        fail: Fail | None = None,
        store: WorkerStore | None = None,
    ):
        """`backend`, `store`: as `GpuResources`; `transport`: pulls from other GPUs; `report`,
        `fail`: called with this GPU's completions and failures."""
        super().__init__(gpu, mg, tg, config, backend=backend, store=store)
        self.transport = transport
        self._report = report
        self._fail_cb = fail
        self.flush_s, self.lazy_s = config.flush_s, config.lazy_s
        self._init_run_state()
        self._carry_sizes = [(self.tg[value].nbytes, self.tg[value].dtype) for value, _, _ in self.carries]
        self._saves = CarrySaves(
            mg, self.plans, self.carries, self._carry_keys, self.loads, self._range, self.backend.async_launch
        )
        # the backend's stream threads run `_work` and report to `_done`
        self.backend.open(self.slots.total, self._work, self._done, self.workspace, self.streams)
        self._reporter = ReportThread(
            gpu,
            None if report is None else lambda batch: report(gpu, batch),
            lambda e: self._fail(None, RunError(f"gpu:{gpu}: reporting completions failed: {e}")),
            lambda: bool(self.slots.running) and self._error is None,
            config.flush_s,
            config.lazy_s,
        )

    def _init_run_state(self) -> None:
        """What a run changes, before the first one."""
        self._skip: frozenset[int] = frozenset()
        self._acc_started: set[str] = set()  # sum-into groups whose first member was launched
        self._acc_first: dict[int, bool] = {}  # sum-into member -> it is its group's first
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # notified when the last vertex in flight lands
        self._sanitizer: Sanitizer | None = None
        self._check = False
        self._mode: dict[int, Mode] = {}  # vid -> how its work behaves, when not LAUNCH
        self._watched: frozenset[int] = frozenset()  # vids whose completion the transport wants to know
        self._delay: tuple[float, float] | None = None
        self._inline: frozenset[int] = frozenset()  # skipped loads `_pump` completes, not their lane
        self._cond = Conditions(self.mg, self.gpu, self.plans)  # vertices a run skips unless flagged
        self._rng = random.Random(0)
        self._finished = threading.Event()
        self._on_end: Callable[[], None] | None = None  # called once when this run ends (`begin`)
        self._end_lock = threading.Lock()
        self._error: str | None = None
        self._coordinated = True  # completions and failures go to the coordinator (not in `run_alone`)
        self.trace: list[tuple[int, int, int, int]] = []

    # ---- a run ---------------------------------------------------------------------------------
    def begin(
        self,
        inputs: Mapping[str, torch.Tensor],
        *,
        check: bool = False,
        delay: tuple[float, float] | None = None,
        seed: int = 0,
        coordinated: bool = True,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        """Resets the counters for a new run on `inputs` (the caller's tensors this GPU reads).

        `on_end`: called once when the run ends, done or failed, by the thread that ends it (a
        stream's, after the last vertex): `actors.steps` begins the next step there.

        `coordinated=False`: a run of a one-GPU plan driven by `run_alone`, which no coordinator
        follows, so completions and failures are not sent to one (`report` and `fail` unused).

        An input missing from `inputs` that an earlier run handed in is the one of that run: the
        worker keeps its copy (in its pinned staging buffer on cuda) and, when the plan never
        overwrites its arena range, the value stays on the GPU too (weights passed by the caller
        cross the host link once).
        """
        with self._lock:
            if self.slots.running and self._error is not None:  # a failed run's vertices still land
                self._landed.wait_for(lambda: not self.slots.running, DRAIN_S)
            if self.slots.running:
                raise RunError(f"gpu:{self.gpu}: a run is still in progress")
            # loads of values the arena still holds from the last run are skipped (actors/loads.py)
            self._skip = self.loads.begin(inputs, self.arena_slot)
            # the states to save, by id at each run: states move and go between runs (move_states)
            state = self.store.state
            self.carries = [
                (value, vid, state(key, *size))
                for (value, vid, _), key, size in zip(self.carries, self._carry_keys, self._carry_sizes)
            ]
            self._acc_started = set()
            self._acc_first = {}
            self._cond.begin()
            self._saves.begin()
            if check:
                if self._sanitizer is None:
                    self._sanitizer = self._new_sanitizer()
                self._sanitizer.reset()
            self._check = check
            lane_of, self._mode = self._lanes(self.transport)
            tr = self.transport
            if tr is not None:  # the completions it waits for (NCCL: its sends' sources); a new run
                self._watched = frozenset(tr.watched())
                tr.begin_run()
            self._delay = delay
            if delay is not None:  # only a delay draws from it
                self._rng = random.Random(seed * 7919 + self.gpu)
            # launch ahead is off while the sanitizer runs on a backend that launches
            # asynchronously: its checks run at launch
            ahead = 0 if check and self.backend.async_launch else self.ahead
            # a random delay (tests) and the sanitizer's checks go into every vertex's work
            inline = delay is None and not check
            self._inline = self._skip - self._watched if inline else frozenset()
            # nothing ahead behind a non-LAUNCH vertex; chains run as units when nothing is
            # checked or delayed between two vertices
            self.slots.start(ahead, lane_of, self._mode, delay is None and not check)
            self.trace = []
            if self.spill is not None:
                self.spill.flush()  # the last run's writes behind are in (RunError if one failed)
                self.spill.reset()
                self._read_ahead().begin()
            self._reporter.reset()
            self._coordinated = coordinated
            self._error = None
            self._finished.clear()
            self._on_end = on_end
            empty = self.core.finished
        if empty:  # outside the lock: `on_end` may begin the next run
            self._end_run()

    def dispatch(self, vids: list[int]) -> None:
        """The coordinator hands over vertices whose remote predecessors are done."""
        try:
            with self._lock:
                if self._error is not None:
                    return
                self.core.dispatch(vids)
                inline = self._pump()
                finished = self.core.finished
        except RunError as e:
            self._fail(None, e)
            return
        self._after_inline(inline, finished)

    def result(
        self, wanted: list[tuple[str, int]]
    ) -> tuple[str | None, dict[str, np.ndarray], list[tuple[int, int, int, int]]]:
        """Once this GPU's vertices are all done or the run failed: (the error message or None,
        the raw bytes of each `wanted` (value, vid) output, the trace records)."""
        self.wait()
        if self._error is not None:
            return self._error, {}, self.trace
        try:
            return None, {value: self.output_bytes(vid) for value, vid in wanted}, self.trace
        except RunError as e:  # the sanitizer, reading an output
            return str(e), {}, self.trace

    def _pump(self) -> list[int]:
        """Launches what is ready (the caller holds the lock). A load skipped because the arena
        holds its value moves nothing: it completes here instead of on its lane's thread (a
        hand-over per load); returns those, for the caller to finish outside the lock."""
        inline: list[int] = []
        mode, now = self._mode, time.time_ns
        skip = self._inline
        took = self.slots.take() if self._error is None else []
        while took:
            n = len(inline)
            for vid, s, waits in took:
                if vid in skip:
                    t = now()
                    self.trace.append((vid, s, t, t))
                    self.core.complete(vid)
                    self.slots.landed(vid, s)
                    inline.append(vid)
                    continue
                key = self.core.groups.get(vid)
                if key is not None:  # one member at a time (the core's lock): the first writes
                    self._acc_first[vid] = key not in self._acc_started
                    self._acc_started.add(key)
                # launched ahead behind a skipped load: that load is done and has no event
                if waits and not skip.isdisjoint(waits):
                    waits = tuple(w for w in waits if w not in skip)
                self.backend.submit(s, vid, waits, mode.get(vid, Mode.LAUNCH))
            took = self.slots.take() if len(inline) > n and self._error is None else []
        return inline

    def _after_inline(self, inline: list[int], finished: bool) -> None:
        """Outside the lock, the end of the run and the reports of what `_pump` completed."""
        if finished and inline:
            self._end_run()
        if self._coordinated and self._report is not None:  # else queued for nobody
            for vid in inline:
                self._reporter.completed(vid, vid in self.core.awaited)

    @property
    def launched_ahead(self) -> int:
        return self.slots.launched_ahead

    def _done(self, vid: int, s: int, t0: int, t1: int, exc: BaseException | None) -> None:
        units = self.slots.units
        unit = units.pop(vid, None) if units else None
        if unit is not None:
            if exc is None and self.backend.async_launch:  # the device timed the unit as a whole
                trace = self.trace
                trace.append((vid, s, t0, t1))
                for m in unit[1:]:
                    trace.append((m, s, t1, t1))
            return self._unit_done(vid, unit, s, exc)
        if exc is None and self._check and self._sanitizer is not None:
            p = self.plans[vid]
            try:
                self._sanitizer.after(vid, p.checks, p.out_loc)
                if p.kind is PlanKind.TRANSFER and self.transport is not None:
                    assert p.src_loc is not None  # a transfer's plan has one
                    self.transport.after_pull(p.src_gpu, p.src_loc, p.out, vid, p.src_vid)
            except RunError as e:
                exc = e
        if exc is not None:
            self._completed((), vid, s, pump=False)
            self._fail(vid, exc)
            return
        # a load skipped because the arena still holds the input moved nothing: a record of no length
        self.trace.append((vid, s, t0, t0 if vid in self._skip else t1))
        self._completed((vid,), vid, s)

    def _unit_done(self, vid: int, unit: tuple[int, ...], s: int, exc: BaseException | None) -> None:
        """`_done` of a unit (launched as `vid`): its vertices complete in order; each has its
        trace record already. When one raised, those before it ran: they complete first (on a
        backend that launches asynchronously they were only enqueued: none counts as done)."""
        if exc is None:
            self._completed(unit, vid, s)
            return
        ran = unit[: unit.index(exc.vid)] if isinstance(exc, InUnit) and not self.backend.async_launch else ()
        self._completed(ran, vid, s, pump=False)
        self._fail(exc.vid, exc.exc) if isinstance(exc, InUnit) else self._fail(vid, exc)

    def _completed(self, vids: tuple[int, ...], vid: int, s: int, pump: bool = True) -> None:
        """`vids` are done and `vid` (the first of them, or a unit's whose later vertices failed)
        left stream `s`: the counters, the next launches (unless `pump` is False: a failure
        follows), the end of the run, the reports."""
        tr = self.transport
        if tr is not None:
            for m in vids:
                if m in self._watched:  # e.g. an NCCL send's source
                    tr.completed(m)
        core = self.core
        with self._lock:
            for m in vids:
                core.complete(m)
            self.slots.landed(vid, s)
            inline = self._pump() if pump else []
            finished = pump and core.done == core.total  # `core.finished` without a call (hot)
            if not self.slots.running:
                self._landed.notify_all()
        if finished:
            self._end_run()
        if self._coordinated and self._report is not None:
            awaited = self.core.awaited
            for m in vids:
                self._reporter.completed(m, m in awaited)  # awaited: reported within flush_s
        if inline:
            self._after_inline(inline, False)

    def _end_run(self) -> None:
        """Every vertex of this GPU is done: saves the carried values as their states and records
        what the arena holds now, then lets `wait` return."""
        try:
            if self.spill is not None:  # the offloads' writes behind: in the file, in the counters
                self._read_ahead().end()
                self.spill.flush()
            self._saves.save(self.carries, self.mg)
            if self._error is None:
                self._cond.forget(self.loads.tokens, self._skip)  # skipped loads left no value
                self.loads.end(self.arena_slot)
        except BaseException as e:
            self._fail(None, RunError(f"gpu:{self.gpu}: saving the carried states failed: {e}"))
        self._ended()

    def _ended(self) -> None:
        """The run ended (done or failed): `wait` returns, and the run's `on_end` is called once."""
        self._finished.set()
        with self._end_lock:
            cb, self._on_end = self._on_end, None
        if cb is not None:
            cb()

    def _fail(self, vid: int | None, exc: BaseException) -> None:
        if isinstance(exc, RunError):
            msg = str(exc) if str(exc).startswith(f"gpu:{self.gpu}") else f"gpu:{self.gpu}: {exc}"
        else:
            msg = (
                f"gpu:{self.gpu} {describe(self.mg, vid) if vid is not None else ''} raised "
                f"{type(exc).__name__}: {exc}"
            )
        with self._lock:
            if self._error is not None:
                return
            self._error = msg
        if self.read_ahead is not None:  # its staging buffers go back
            self.read_ahead.end()
        self._reporter.flush()  # what completed before the failure reaches the coordinator first
        self._ended()  # `on_end` is given only to runs no coordinator follows (no `_fail_cb` then)
        if self._fail_cb is not None and self._coordinated:
            self._fail_cb(self.gpu, vid, msg)

    def fail(self, message: str) -> None:
        """Ends the run with `message` (a transport's channel that found its peer lost)."""
        self._fail(None, RunError(message))

    @property
    def reports(self) -> int:
        return self._reporter.reports

    def wait(self, timeout: float | None = None) -> bool:
        """True once every vertex of this GPU completed or the run failed."""
        return self._finished.wait(timeout)

    @property
    def error(self) -> str | None:
        return self._error

    def statistics(self) -> dict:
        """What this GPU holds (`GpuResources.held`) and what its last run did."""
        return {
            **self.held(),
            "done": self.core.done,
            "reports": self.reports,
            "report_interval_ms": round(self._reporter.core.interval * 1e3, 3),
            "report_call_ms": self._reporter.core.call_s * 1e3,  # host time of one report (mean)
            "ahead": self.ahead,
            "launched_ahead": self.launched_ahead,
            "chained": {"units": self.slots.chained[0], "vertices": self.slots.chained[1]},
            "sanitizer_checks": self._sanitizer.checks if self._sanitizer else 0,
            "loads_skipped": len(self._skip),
            **({"conditional": self._cond.statistics(self._skip)} if self._cond.when else {}),
            # of those, loads of a state its last run wrote back into the range (actors/carries.py)
            "state_loads_skipped": sum(1 for v in self._skip if self.plans[v].value in self.loads.states),
        }

    def close(self) -> None:
        self._reporter.close()
        self.backend.close()
        self.loads.release()
        if self.read_ahead is not None:
            self.read_ahead.close()
        if self.spill is not None:
            self.spill.close()
        # drop every view of the arena, so that the store's release really frees it
        self._saves.release()
        self.views = self.arena = self.arena_slot = None  # type: ignore[assignment]
        self.plans = {}
        self.store.release_arena(self.mg.capacity[self.gpu])
