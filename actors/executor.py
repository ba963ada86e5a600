"""One GPU worker's execution engine: arena, host store, streams, local counters, batched reports.

Shared by the Ray actor shell (`actors.worker.GpuWorker`) and the local engine. Everything is
allocated in `__init__` (arena, host store, a torch view per vertex operand: `actors.resources`;
stream threads); a run only issues copies and kernels on those views (TURNIP section 5: no allocation while a graph
runs; the host-side copy a Ray transfer returns is the one exception, see `read_range`). What it
calls on its backend, transport and spill tier is their contract (`actors.backends.base`,
`actors.transports.base`, `actors.tiers.base`).

Launch path (hot): a completion, in the thread that found it, updates the local counters
(`actors.worker_core.WorkerCore`) under one lock, and `StreamSlots` picks what to start on which
stream: a ready kernel on a free compute stream, a ready copy on its lane (loads, offloads, the
transfers from each peer: a copy never waits for a compute stream), or with launch ahead
(`ahead` > 0) a kernel behind its running predecessors, which the backend starts once they are
done (CUDA: the stream waits on their events; cpu: the stream thread waits), so on a GPU the
host prepares the next kernels of a chain while the current one runs. Launch ahead is off while
the sanitizer runs on a backend that launches asynchronously (its checks run at launch). The
completion goes to the reporter (`actors.reporter`), which batches completions for the
coordinator with a bounded lag.

Streams of a worker: 0..S-1 compute; then the lanes: host-to-device (inputs, reloads),
device-to-host (offloads), one per peer this GPU receives transfers from, one for deferred
transfers (NCCL: one communicator, its operations in one order, `actors.transports.nccl`), and,
when the plan spills, two disk lanes (offloads to and reloads from the worker's spill file,
`actors.tiers.spill.SpillFile`, which writes behind; reloads read ahead,
`actors.tiers.spill.ReadAhead`): disk I/O waits on the host, so it gets lanes of its own and
never holds back a host copy; it runs aside (BLOCKING) on cuda.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.kernels import CHANGED
from disco_ray.graph.memgraph import DISK, Loc, MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .backends.base import Backend, Mode
from .options import DEFAULT_WORKER, WorkerConfig
from .plans import PlanKind, as_tensor, describe
from .reporter import ReportThread
from .resources import GpuResources
from .sanitizer import Sanitizer
from .tiers.store import WorkerStore
from .transports.base import Transport

Report = Callable[[int, list[int]], None]  # (gpu, completed vids)
Fail = Callable[[int, int | None, str], None]  # (gpu, vid, message)


class Executor(GpuResources):
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
        self._deltas = self._delta_saves()
        # each carried value's bytes as a numpy view, made once (None: not in host memory)
        self._carry_np = [self._host_view(self.mg.vertex(vid).out, vid) for _, vid, _ in self.carries]
        self._mirrors = self._state_mirrors()
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
        self._changed: dict[int, tuple[int, int]] = {}  # delta-saved writer -> its changed bytes
        self._lock = threading.Lock()
        self._sanitizer: Sanitizer | None = None
        self._check = False
        self._mode: dict[int, Mode] = {}  # vid -> how its work behaves, when not LAUNCH
        self._watched: frozenset[int] = frozenset()  # vids whose completion the transport wants to know
        self._delay: tuple[float, float] | None = None
        self._inplace = True  # skipped loads complete in `_pump`, not on their lane
        self._rng = random.Random(0)
        self._finished = threading.Event()
        self._error: str | None = None
        self._coordinated = True  # completions and failures go to the coordinator (not in `run_alone`)
        self.trace: list[tuple[int, int, int, int]] = []

    def _delta_saves(self) -> frozenset[int]:
        """The carried values' last writers whose output is their own state as loaded this run
        with a few bytes changed (a `CHANGED` op on top of the state's load): `_end_run` saves only
        those bytes. On a backend that launches asynchronously, the range would cost a sync: none."""
        if self.backend.async_launch:
            return frozenset()
        out = []
        for (_, vid, _), key in zip(self.carries, self._carry_keys):
            v = self.mg.vertex(vid)
            if (
                self.plans[vid].kind is PlanKind.KERNEL
                and self.plans[vid].op in CHANGED
                and v.acc is None
                and v.ins
                and v.ins[0].value == key
                and key in self.loads.states
                and self._carry_keys.count(key) == 1
            ):
                out.append(vid)
        return frozenset(out)

    def _state_mirrors(self) -> dict[int, list[tuple[tuple[int, int], np.ndarray, str]]]:
        """Delta-saved writer -> the stable loads of its state ((offset, bytes), a numpy view):
        ranges that hold the state as this run loaded it. `_end_run` writes the changed bytes
        there too, so they hold the new version and the next run skips those loads."""
        out: dict[int, list[tuple[tuple[int, int], np.ndarray, str]]] = {}
        for (_, vid, _), key, view in zip(self.carries, self._carry_keys, self._carry_np):
            if vid not in self._deltas or view is None:
                continue
            for u in self.loads.stable:
                loc = self.plans[u].out_loc
                if self.plans[u].value == key and (mirror := self._host_view(loc, u)) is not None:
                    out.setdefault(vid, []).append(((loc.offset, loc.nbytes), mirror, key))
        return out

    def _host_view(self, loc: Loc, vid: int) -> np.ndarray | None:
        """A numpy view of `loc` when it is in host memory (the cpu backend's arena, the host
        store), else None."""
        if loc.device == DISK:
            return None
        buf = self._range(loc, vid)
        return buf.numpy() if buf.device.type == "cpu" else None

    # ---- a run ---------------------------------------------------------------------------------
    def begin(
        self,
        inputs: Mapping[str, torch.Tensor],
        *,
        check: bool = False,
        delay: tuple[float, float] | None = None,
        seed: int = 0,
        coordinated: bool = True,
    ) -> None:
        """Resets the counters for a new run on `inputs` (the caller's tensors this GPU reads).

        `coordinated=False`: a run of a one-GPU plan driven by `run_alone`, which no coordinator
        follows, so completions and failures are not sent to one (`report` and `fail` unused).

        An input missing from `inputs` that an earlier run handed in is the one of that run: the
        worker keeps its copy (in its pinned staging buffer on cuda) and, when the plan never
        overwrites its arena range, the value stays on the GPU too (weights passed by the caller
        cross the host link once).
        """
        with self._lock:
            if self.slots.running:
                raise RunError(f"gpu:{self.gpu}: a run is still in progress")
            # loads of values the arena still holds from the last run are skipped (actors/loads.py)
            self._skip = self.loads.begin(inputs, self.arena_slot)
            # the states to save, by id at each run: states move and go between runs (move_states)
            self.carries = [
                (value, vid, self.store.state(key, self.tg[value].nbytes, self.tg[value].dtype))
                for (value, vid, _), key in zip(self.carries, self._carry_keys)
            ]
            self._acc_started = set()
            self._acc_first = {}
            self._changed = {}
            if check:
                if self._sanitizer is None:
                    self._sanitizer = Sanitizer(
                        self.gpu,
                        self.arena.numel(),
                        self.host.numel(),
                        self.granule,
                        lambda vid: describe(self.mg, vid),
                        self._acc_alias(),
                        self.spill.nbytes if self.spill is not None else 0,
                    )
                self._sanitizer.reset()
            self._check = check
            lane_of, self._mode = self._lanes()
            tr = self.transport
            if tr is not None:  # the completions it waits for (NCCL: its sends' sources); a new run
                self._watched = frozenset(tr.watched())
                tr.begin_run()
            self._delay = delay
            # a random delay (tests) goes into every vertex's work, skipped loads too
            self._inplace = delay is None
            self._rng = random.Random(seed * 7919 + self.gpu)
            # launch ahead is off while the sanitizer runs on a backend that launches
            # asynchronously: its checks run at launch
            ahead = 0 if check and self.backend.async_launch else self.ahead
            self.slots.start(ahead, lane_of)
            self.trace = []
            if self.spill is not None:
                self.spill.flush()  # the last run's writes behind are in (RunError if one failed)
                self.spill.reset()
                self._read_ahead().begin()
            self._reporter.reset()
            self._coordinated = coordinated
            self._error = None
            self._finished.clear()
            if self.core.finished:
                self._end_run()

    def _lanes(self) -> tuple[dict[int, int], dict[int, Mode]]:
        """(the lane of each copy and transfer, the mode of each vertex whose work is not LAUNCH)."""
        tr = self.transport
        mode_of = (lambda src: Mode.BLOCKING) if tr is None else tr.mode
        # a table per plan, kept: it only changes with the transport's mode of each peer
        key = tuple(mode_of(p) for p in self.peers)
        got = self._lane_tables.get(key)
        if got is None:
            got = self._lane_tables[key] = self.lanes.assign((self.mg.vertex(v) for v in self.plans), mode_of)
        return got

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

    def run_alone(
        self,
        inputs: Mapping[str, torch.Tensor],
        wanted: list[tuple[str, int]],
        *,
        check: bool = False,
        delay: tuple[float, float] | None = None,
        seed: int = 0,
    ) -> tuple[str | None, dict[str, np.ndarray], list[tuple[int, int, int, int]]]:
        """A whole run of a one-GPU plan, with no coordinator: every vertex is dispatched at once
        (none has a remote predecessor, so the coordinator's `start` would hand over all of them),
        and the end is this GPU's own. Returns (the error message or None, the raw bytes of each
        `wanted` (value, vid) output, the trace records): one call per run instead of a begin, a
        start, reports and an end call (docs/RUNTIME.md, "One worker")."""
        if self.mg.gpus != 1:
            raise RunError(f"gpu:{self.gpu}: run_alone needs a one-GPU plan, this one has {self.mg.gpus}")
        self.begin(inputs, check=check, delay=delay, seed=seed, coordinated=False)
        self.dispatch(self.core.mine)
        self.wait()
        if self._error is not None:
            return self._error, {}, self.trace
        try:
            outs = {value: self.output_bytes(vid) for value, vid in wanted}
        except RunError as e:  # the sanitizer, reading an output
            return str(e), {}, self.trace
        return None, outs, self.trace

    def completed_since(self, n: int) -> list[int]:
        """The vertices this run completed after its first `n` (the driver of a `run_alone` run
        keeps count, to name what a dead worker held)."""
        return [r[0] for r in self.trace[n:]]

    def _pump(self) -> list[tuple[int, BaseException | None]]:
        """Launches what is ready (the caller holds the lock). A load skipped because the arena
        holds its value moves nothing: it completes here, in this thread, instead of going through
        its lane's thread (a hand-over per load). Returns those, each with what its sanitizer
        checks raised, for the caller to finish outside the lock (`_after_inline`)."""
        inline: list[tuple[int, BaseException | None]] = []
        mode, skip, inplace = self._mode, self._skip, self._inplace
        while self._error is None:
            again = False
            for vid, s, waits in self.slots.take():
                if inplace and vid in skip and vid not in self._watched:
                    exc = self._skip_load(vid, s)
                    inline.append((vid, exc))
                    if exc is not None:
                        return inline
                    again = True
                    continue
                key = self.core.groups.get(vid)
                if key is not None:  # one member at a time (the core's lock): the first writes
                    self._acc_first[vid] = key not in self._acc_started
                    self._acc_started.add(key)
                self.backend.submit(s, vid, waits, mode.get(vid, Mode.LAUNCH))
            if not again:
                break
        return inline

    def _skip_load(self, vid: int, s: int) -> BaseException | None:
        """Completes skipped load `vid` (given stream `s`) in place: its sanitizer checks, a trace
        record of no length, the counters (the caller holds the lock)."""
        san = self._sanitizer if self._check else None
        if san is not None:
            p = self.plans[vid]
            try:
                for value, loc, src in p.checks:
                    san.check_read(vid, value, loc, src, "before it ran")
                san.begin_write(p.out_loc, vid)
                san.end_write(p.out_loc, vid)
            except RunError as e:
                self.slots.landed(vid, s)
                return e
        t = time.time_ns()
        self.trace.append((vid, s, t, t))
        self.core.complete(vid)
        self.slots.landed(vid, s)
        return None

    def _after_inline(self, inline: list[tuple[int, BaseException | None]], finished: bool) -> None:
        """Outside the lock, what `_pump` completed in place: a failure, the end, the reports."""
        for vid, exc in inline:
            if exc is not None:
                self._fail(vid, exc)
                return
        if finished and inline:
            self._end_run()
        if self._coordinated:
            for vid, _ in inline:
                self._reporter.completed(vid, vid in self.core.awaited)

    @property
    def launched_ahead(self) -> int:
        return self.slots.launched_ahead

    def _work(self, vid: int, s: int) -> None:
        if self._error is not None:  # the run failed: what was launched ahead is skipped
            return
        p = self.plans[vid]
        san = self._sanitizer if self._check else None
        if san is not None:
            for value, loc, src in p.checks:
                san.check_read(vid, value, loc, src, "before it ran")
            san.begin_write(p.out_loc, vid)
        if self._delay is not None:  # inside the write: a writer overlapping it is seen
            time.sleep(self._rng.uniform(*self._delay))
        k = p.kind
        if k is PlanKind.KERNEL and vid in self.core.groups and not self._acc_first[vid]:
            self.backend.kernel("add", p.out, [p.out, p.ins[0]], p.attrs)  # sum-into: add the operand
        elif k is PlanKind.KERNEL:
            self.backend.kernel(p.op, p.out, p.ins, p.attrs)
            if vid in self._deltas:  # a carried value's last writer: which bytes the state changes
                self._changed[vid] = CHANGED[p.op](p.out, p.ins, p.attrs)
        elif k is PlanKind.COPY:
            self.backend.copy(p.out, p.ins[0])
        elif k is PlanKind.SPILL:
            self._spill().write(p.out_loc.offset, p.ins[0])
            self._read_ahead().written(vid)
        elif k is PlanKind.UNSPILL:
            assert p.src_loc is not None  # a reload from disk's plan has one
            if not self._read_ahead().take(vid, p.out, self.backend.copy):
                self._spill().read(p.src_loc.offset, p.out, self.backend.copy)
        elif k is PlanKind.TRANSFER:
            if self.transport is None:
                raise RunError(f"gpu:{self.gpu}: no transport for {describe(self.mg, vid)}")
            assert p.src_loc is not None  # a transfer's plan has one
            self.transport.pull(p.src_gpu, p.src_loc, p.out, vid, p.src_vid)
        elif vid not in self._skip:
            self.loads.load(p.value, p.out, self.backend.copy)

    def _done(self, vid: int, s: int, t0: int, t1: int, exc: BaseException | None) -> None:
        if exc is None and self._check and self._sanitizer is not None:
            p = self.plans[vid]
            try:
                for value, loc, src in p.checks:
                    self._sanitizer.check_read(vid, value, loc, src, "after it ran")
                self._sanitizer.end_write(p.out_loc, vid)
                if p.kind is PlanKind.TRANSFER and self.transport is not None:
                    assert p.src_loc is not None  # a transfer's plan has one
                    self.transport.after_pull(p.src_gpu, p.src_loc, p.out, vid, p.src_vid)
            except RunError as e:
                exc = e
        if exc is not None:
            with self._lock:
                self.slots.landed(vid, s)
            self._fail(vid, exc)
            return
        # a load skipped because the arena still holds the input moved nothing: a record of no length
        self.trace.append((vid, s, t0, t0 if vid in self._skip else t1))
        if vid in self._watched and self.transport is not None:  # e.g. an NCCL send's source
            self.transport.completed(vid)
        with self._lock:
            self.core.complete(vid)
            self.slots.landed(vid, s)
            inline = self._pump()
            finished = self.core.finished
        if finished:
            self._end_run()
        if self._coordinated:
            self._reporter.completed(vid, vid in self.core.awaited)  # awaited: reported within flush_s
        if inline:
            self._after_inline(inline, False)

    def _end_run(self) -> None:
        """Every vertex of this GPU is done: saves the carried values as their states and records
        what the arena holds now, then lets `wait` return."""
        try:
            if self.spill is not None:  # the offloads' writes behind: in the file, in the counters
                self._read_ahead().end()
                self.spill.flush()
            changed = self._changed
            for (_, vid, st), view in zip(self.carries, self._carry_np):
                if view is None:
                    src = self._range(self.mg.vertex(vid).out, vid)
                    lo, hi = changed.get(vid, (0, src.numel()))
                    save(st.buf[lo:hi], src[lo:hi])
                else:  # a memcpy of numpy views: torch's slicing and copy_ cost 10-20 us each
                    lo, hi = changed.get(vid, (0, view.size))
                    np.copyto(st.buf.numpy()[lo:hi], view[lo:hi])  # the rest: the state as loaded
                st.version += 1
                if vid in changed and self._error is None:
                    for where, mirror, key in self._mirrors.get(vid, ()):
                        np.copyto(mirror[lo:hi], view[lo:hi])
                        self.loads.kept(where, key, st)
            if self._error is None:
                self.loads.end(self.arena_slot)
        except BaseException as e:
            self._fail(None, RunError(f"gpu:{self.gpu}: saving the carried states failed: {e}"))
        self._finished.set()

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
        self._finished.set()
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

    def read_range(self, loc: Loc, reader: int, expect: int, into: torch.Tensor | None = None):
        """Bytes of `loc` (this GPU's arena, host store or spill file), checked by the sanitizer
        when it is on.

        Copies into `into` when given; otherwise returns a fresh numpy copy (what a Ray call
        ships; the only allocation during a run, on the cpu transport).
        """
        src = self._range(loc, reader)
        san = self._sanitizer if self._check else None
        value = self.mg.vertex(expect).value if expect >= 0 else "?"
        if san is not None and expect >= 0:
            san.check_read(reader, value, loc, expect, "before it ran")
        if into is not None:
            into.copy_(src)
            out = None
        else:
            out = src.to("cpu", copy=True).numpy()
        if san is not None and expect >= 0:
            san.check_read(reader, value, loc, expect, "after it ran")
        return out

    def _range(self, loc: Loc, vid: int) -> torch.Tensor:
        """The bytes of `loc`: a view of the arena or host store, a copy of a spill-file range."""
        if loc.device == DISK and self.spill is not None:  # a kept value the plan left on disk
            out = torch.empty(loc.nbytes, dtype=torch.uint8)
            self.spill.read(loc.offset, out, lambda d, s: d.copy_(s))
            return out
        return self.views.buf(loc, vid)

    def output_bytes(self, vid: int) -> np.ndarray:
        """A copy of the bytes of the output held by vertex `vid` of this GPU (checked if `check`)."""
        return self.read_range(self.mg.vertex(vid).out, vid, vid)

    def output(self, value: str, vid: int) -> torch.Tensor:
        """A copy of output `value`, held by vertex `vid` of this GPU, as a typed CPU tensor."""
        return as_tensor(self.output_bytes(vid), self.tg[value])

    def statistics(self) -> dict:
        return {
            "gpu": self.gpu,
            "vertices": len(self.plans),
            "done": self.core.done,
            "reports": self.reports,
            "report_interval_ms": round(self._reporter.core.interval * 1e3, 3),
            "report_call_ms": self._reporter.core.call_s * 1e3,  # host time of one report (mean)
            "streams": self.streams,
            "lanes": self.slots.total - self.streams,
            "workspace_bytes": self.workspace,
            "ahead": self.ahead,
            "launched_ahead": self.launched_ahead,
            "arena_bytes": self.arena.numel(),
            "host_bytes": self.host.numel(),
            "granule": self.granule,
            "sanitizer_checks": self._sanitizer.checks if self._sanitizer else 0,
            "loads_skipped": len(self._skip),
            "store": self.store.statistics(),
            **(
                {
                    "disk": {
                        **self.spill.statistics(),
                        "read_ahead": self._read_ahead().statistics(),
                    }
                }
                if self.spill is not None
                else {}
            ),
            **({"backend": backend} if (backend := self.backend.statistics()) else {}),
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
        self._carry_np, self._mirrors = [], {}
        self.views = self.arena = self.arena_slot = None  # type: ignore[assignment]
        self.plans = {}
        self.store.release_arena(self.mg.capacity[self.gpu])


def save(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[:] = src` (uint8, same size): one memcpy when both are in host memory (torch's `copy_`
    splits a large copy over its thread pool, which waits for cores on a busy machine)."""
    if src.device.type == "cpu" and dst.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)
