"""One GPU worker's execution engine: arena, host store, streams, local counters, batched reports.

Shared by the Ray actor shell (`actors.worker.GpuWorker`) and the local engine. Everything is
allocated in `__init__` (arena, host store, a torch view per vertex operand, stream threads); a
run only issues copies and kernels on those views (TURNIP section 5: no allocation while a graph
runs; the host-side copy a Ray transfer returns is the one exception, see `read_range`).

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
transfers (NCCL: one communicator, its operations in one order, `actors.nccl_channel`), and,
when the plan spills, two disk lanes (offloads to and reloads from the worker's spill file,
`actors.spill.SpillFile`, which writes behind; reloads read ahead, `actors.spill.ReadAhead`):
disk I/O waits on the host, so it gets lanes of its own and never holds back a host copy; it
runs aside (BLOCKING) on cuda.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from disco_ray.graph.errors import RunError, UsageError
from disco_ray.graph.kernels import temp_bytes
from disco_ray.graph.memgraph import DISK, HOST, Loc, MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .backend import BLOCKING, LAUNCH, Backend
from .backend_cpu import CpuBackend
from .lanes import Lanes
from .loads import Loads
from .plans import (
    K_COPY,
    K_KERNEL,
    K_SPILL,
    K_TRANSFER,
    K_UNSPILL,
    VertexPlan,
    Views,
    as_tensor,
    describe,
)
from .reporter import ReportThread
from .sanitizer import Sanitizer, granule_for
from .spill import ReadAhead, SpillFile
from .store import WorkerStore
from .transport import Transport
from .worker_core import StreamSlots, WorkerCore

Report = Callable[[int, list[int]], None]  # (gpu, completed vids)
Fail = Callable[[int, int | None, str], None]  # (gpu, vid, message)


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The settings of one run, taken by every engine."""

    check: bool = False  # the sanitizer: every read checks its writer (actors/sanitizer.py)
    delay: tuple[float, float] | None = None  # debug: sleep uniform(lo, hi) s before each vertex
    seed: int = 0  # seeds the delays
    timeout: float | None = None  # give up (RunError) after this many seconds; None: never
    progress: Callable[[int], None] | None = None  # called with the number of vertices done


DEFAULT_RUN = RunOptions()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How every worker of a Program runs its vertices (given once, to each engine and worker)."""

    backend: str = "cpu"  # "cpu" or "cuda"
    streams: int = 5  # streams per GPU
    ahead: int | None = None  # kernels launched ahead per stream; None: the backend's default
    flush_s: float = 1e-3  # longest a busy worker holds back a completion another GPU waits for
    lazy_s: float = 0.05  # longest it may hold back the others (see actors/reporter.py)
    sources: str = "host"  # sourced inputs: "host" (read once, kept) or "disk" (read at each load)
    disk_dir: str | None = None  # where a worker whose plan spills makes its spill file (None: a temp dir)

    def __post_init__(self) -> None:
        if self.sources not in ("host", "disk"):
            raise RunError(f"sources must be 'host' or 'disk', got {self.sources!r}")
        if self.streams < 1:
            raise RunError(f"streams must be >= 1, got {self.streams}")
        if self.ahead is not None and self.ahead < 0:
            raise RunError(f"ahead must be >= 0, got {self.ahead}")


DEFAULT_WORKER = WorkerConfig()


class Executor:
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
        """`backend`: an instance to use instead of making `config.backend`'s. `store`: the worker's
        arena, resident inputs and states, shared with its other graphs (default: a store of its own)."""
        self.gpu, self.mg, self.tg = gpu, mg, tg
        self.backend = make_backend(config.backend) if backend is None else backend
        if store is None:
            store = WorkerStore(gpu, self.backend.alloc, getattr(self.backend, "stages_inputs", False))
        self.store = store
        self.streams = streams = config.streams
        # None: the backend's default (cuda 4; cpu 0, where a stream thread runs its work itself)
        self.ahead = getattr(self.backend, "default_ahead", 0) if config.ahead is None else config.ahead
        self.transport = transport
        self._report = report
        self._fail_cb = fail
        self.flush_s, self.lazy_s = config.flush_s, config.lazy_s
        self.core = WorkerCore(mg, gpu)
        mine = [mg.vertex(v) for v in self.core.mine]
        host_need = max(
            [v.out.end for v in mine if v.out.device == HOST]
            + [r.loc.end for v in mine for r in v.ins if r.loc.device == HOST]
            + [0]
        )
        declared = mg.host_capacity[gpu] if gpu < len(mg.host_capacity) else 0
        self.arena_slot = store.arena(mg.capacity[gpu])
        self.arena = self.arena_slot.buf
        self.host = self.backend.alloc(max(declared, host_need), host=True)
        self.granule = granule_for([v.out for v in mine] + [r.loc for v in mine for r in v.ins])
        self.views = Views(gpu, mg, tg, self.arena, self.host)
        self.plans: dict[int, VertexPlan] = {v.id: self.views.plan(v) for v in mine}
        stage = getattr(self.backend, "stages_inputs", False)
        self.loads = Loads(
            gpu, mg, tg, self.plans, store, self.backend.alloc, stage, config.sources == "disk"
        )
        self.input_values = self.loads.caller  # what the caller hands in
        self.staging = self.loads.staging
        try:  # carried values of this GPU: (value, the vertex holding it at the end, its state)
            self.carries = [
                (value, mg.outputs[value], store.state(key, tg[value].nbytes, tg[value].dtype))
                for value, key in tg.carry.items()
                if tg[value].gpu == gpu
            ]
        except BaseException:
            self.loads.release()
            raise
        self._skip: frozenset[int] = frozenset()
        self._acc_started: set[str] = set()  # sum-into groups whose first member was launched
        self._acc_first: dict[int, bool] = {}  # sum-into member -> it is its group's first
        self._lock = threading.Lock()
        self._sanitizer: Sanitizer | None = None
        self._check = False
        self._mode: dict[int, int] = {}  # vid -> how its work behaves (actors.backend), when not LAUNCH
        self._watched: frozenset[int] = frozenset()  # vids whose completion the transport wants to know
        self._completed_hook: Callable[[int], None] | None = None
        self._after_pull: Callable[..., None] | None = None
        self._delay: tuple[float, float] | None = None
        self._rng = random.Random(0)
        self._finished = threading.Event()
        self._error: str | None = None
        # lanes after the compute streams: loads, offloads, a lane per peer sending to this GPU,
        # and the deferred lane (no limit: NCCL posts its receives in its own order)
        disk_locs = [v.out for v in mine if v.out.device == DISK]
        disk_locs += [r.loc for v in mine for r in v.ins if r.loc.device == DISK]
        self.spill: SpillFile | None = None
        if disk_locs:
            disk_need = max(loc.end for loc in disk_locs)
            declared = mg.disk_capacity[gpu] if gpu < len(mg.disk_capacity) else 0
            largest = max(loc.nbytes for loc in disk_locs)
            self.spill = SpillFile(
                config.disk_dir, gpu, max(declared, disk_need), largest, self.backend.alloc
            )
        # reloads from disk, read ahead in the plan's order once their offload has run
        self.read_ahead: ReadAhead | None = None
        if self.spill is not None:
            items = [
                (vid, p.src_vid, p.src_loc.offset, p.src_loc.nbytes)
                for vid, p in sorted(self.plans.items())
                if p.kind == K_UNSPILL and p.src_loc is not None
            ]
            self.read_ahead = ReadAhead(self.spill, items, self.backend.alloc)
        self.lanes = lanes = Lanes.of(mg, gpu, streams)  # the lane rule (actors/lanes.py)
        self.peers = list(lanes.peers)
        self.h2d, self.d2h, self.peer_lane = lanes.h2d, lanes.d2h, lanes.peer
        self.deferred_lane, self.disk_w, self.disk_r = lanes.deferred, lanes.disk_w, lanes.disk_r
        self.slots = StreamSlots(self.core, streams, lanes.limits)
        self.trace: list[tuple[int, int, int, int]] = []
        # kernel temporaries: the most any kernel of this GPU needs, kept ready per compute stream
        self.workspace = max(
            [temp_bytes(p.op, p.out, p.ins, p.attrs) for p in self.plans.values() if p.kind == K_KERNEL] + [0]
        )
        self.backend.open(self.slots.total, self._work, self._done, self.workspace, streams)
        self._reporter = ReportThread(
            gpu,
            None if report is None else lambda batch: report(gpu, batch),
            lambda e: self._fail(None, RunError(f"gpu:{gpu}: reporting completions failed: {e}")),
            lambda: bool(self.slots.running) and self._error is None,
            config.flush_s,
            config.lazy_s,
        )

    # ---- a run ---------------------------------------------------------------------------------
    def begin(
        self,
        inputs: Mapping[str, torch.Tensor],
        *,
        check: bool = False,
        delay: tuple[float, float] | None = None,
        seed: int = 0,
    ) -> None:
        """Resets the counters for a new run on `inputs` (the caller's tensors this GPU reads).

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
            self._acc_started = set()
            self._acc_first = {}
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
            # a transport's optional hooks (actors/transport_cuda.py): a new run, the completions
            # it waits for (NCCL sends), the check of a finished pull under the sanitizer
            tr = self.transport
            self._watched = frozenset(getattr(tr, "watched", lambda: ())())
            self._completed_hook = getattr(tr, "completed", None)
            self._after_pull = getattr(tr, "after_pull", None) if check else None
            begin_run = getattr(tr, "begin_run", None)
            if begin_run is not None:
                begin_run()
            self._delay = delay
            self._rng = random.Random(seed * 7919 + self.gpu)
            # launch ahead is off while the sanitizer runs on a backend that launches
            # asynchronously: its checks run at launch
            ahead = 0 if check and getattr(self.backend, "async_launch", False) else self.ahead
            self.slots.start(ahead, lane_of)
            self.trace = []
            if self.spill is not None:
                self.spill.flush()  # the last run's writes behind are in (RunError if one failed)
                self.spill.reset()
                cast(ReadAhead, self.read_ahead).begin()
            self._reporter.reset()
            self._error = None
            self._finished.clear()
            if self.core.finished:
                self._end_run()

    def _lanes(self) -> tuple[dict[int, int], dict[int, int]]:
        """(the lane of each copy and transfer, the mode of each vertex whose work is not LAUNCH)."""
        tr = self.transport
        mode_of = (lambda src: BLOCKING) if tr is None else tr.mode
        return self.lanes.assign((self.mg.vertex(v) for v in self.plans), mode_of)

    def dispatch(self, vids: list[int]) -> None:
        """The coordinator hands over vertices whose remote predecessors are done."""
        try:
            with self._lock:
                if self._error is not None:
                    return
                self.core.dispatch(vids)
                self._pump()
        except RunError as e:
            self._fail(None, e)

    def _acc_alias(self) -> dict[int, int]:
        """Sum-into member -> its group's last member (the writer its readers name)."""
        last: dict[str, int] = {}
        for vid, key in self.core.groups.items():
            last[key] = max(last.get(key, vid), vid)
        return {vid: last[key] for vid, key in self.core.groups.items()}

    def _pump(self) -> None:
        # caller holds the lock
        if self._error is None:
            mode = self._mode
            for vid, s, waits in self.slots.take():
                key = self.core.groups.get(vid)
                if key is not None:  # one member at a time (the core's lock): the first writes
                    self._acc_first[vid] = key not in self._acc_started
                    self._acc_started.add(key)
                self.backend.submit(s, vid, waits, mode.get(vid, LAUNCH))

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
        if k == K_KERNEL and vid in self.core.groups and not self._acc_first[vid]:
            self.backend.kernel("add", p.out, [p.out, p.ins[0]], p.attrs)  # sum-into: add the operand
        elif k == K_KERNEL:
            self.backend.kernel(p.op, p.out, p.ins, p.attrs)
        elif k == K_COPY:
            self.backend.copy(p.out, p.ins[0])
        elif k == K_SPILL:
            cast(SpillFile, self.spill).write(p.out_loc.offset, p.ins[0])
            cast(ReadAhead, self.read_ahead).written(vid)
        elif k == K_UNSPILL:
            assert p.src_loc is not None  # a reload from disk's plan has one
            if not cast(ReadAhead, self.read_ahead).take(vid, p.out, self.backend.copy):
                cast(SpillFile, self.spill).read(p.src_loc.offset, p.out, self.backend.copy)
        elif k == K_TRANSFER:
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
                if p.kind == K_TRANSFER and self._after_pull is not None:
                    assert p.src_loc is not None  # a transfer's plan has one
                    self._after_pull(p.src_gpu, p.src_loc, p.out, vid, p.src_vid)
            except RunError as e:
                exc = e
        if exc is not None:
            with self._lock:
                self.slots.landed(vid, s)
            self._fail(vid, exc)
            return
        # a load skipped because the arena still holds the input moved nothing: a record of no length
        self.trace.append((vid, s, t0, t0 if vid in self._skip else t1))
        if vid in self._watched and self._completed_hook is not None:  # an NCCL send's source
            self._completed_hook(vid)
        with self._lock:
            self.core.complete(vid)
            self.slots.landed(vid, s)
            self._pump()
            finished = self.core.finished
        if finished:
            self._end_run()
        self._reporter.completed(vid, vid in self.core.awaited)  # awaited: reported within flush_s

    def _end_run(self) -> None:
        """Every vertex of this GPU is done: saves the carried values as their states and records
        what the arena holds now, then lets `wait` return."""
        try:
            if self.spill is not None:  # the offloads' writes behind: in the file, in the counters
                cast(ReadAhead, self.read_ahead).end()
                self.spill.flush()
            for _, vid, st in self.carries:
                st.buf.copy_(self._range(self.mg.vertex(vid).out, vid))
                st.version += 1
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
        if self._fail_cb is not None:
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
                        "read_ahead": cast(ReadAhead, self.read_ahead).statistics(),
                    }
                }
                if self.spill is not None
                else {}
            ),
            **({"backend": self.backend.statistics()} if hasattr(self.backend, "statistics") else {}),
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
        self.views = self.arena = self.arena_slot = None  # type: ignore[assignment]
        self.plans = {}
        self.store.release_arena(self.mg.capacity[self.gpu])


def make_backend(name: str, device: int | None = None) -> Backend:
    """The backend called `name` ("cpu" or "cuda"; `device`: the CUDA device index to use)."""
    if name == "cpu":
        return CpuBackend()
    if name == "cuda":
        try:
            from .backend_cuda import CudaBackend
        except ImportError:
            raise UsageError("backend 'cuda' is not available in this build (use --backend cpu)") from None
        return CudaBackend(device)
    raise UsageError(f"unknown backend {name!r} (cpu or cuda)")
