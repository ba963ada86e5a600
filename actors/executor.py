"""One GPU worker's execution engine: arena, host store, streams, local counters, batched reports.

Shared by the Ray actor shell (`actors.worker.GpuWorker`) and the local engine. Everything is
allocated in `__init__` (arena, host store, a torch view per vertex operand, stream threads); a
run only issues copies and kernels on those views (TURNIP section 5: no allocation while a graph
runs; the host-side copy a Ray transfer returns is the one exception, see `read_range`).

Launch path (hot): a completion, in the stream thread that ran the vertex, updates the local
counters (`actors.worker_core.WorkerCore`) under one lock, and `StreamSlots` picks what to start
on which stream: a ready vertex on a free stream, or with launch ahead (`ahead` > 0) a kernel
behind its running predecessors, which the backend starts once they are done (CUDA: the stream
waits on their events; cpu: the stream thread waits), so on a GPU the host prepares the next
kernels of a chain while the current one runs. Launch ahead is off while the sanitizer runs on a
backend that launches asynchronously (its checks run at launch). The
completion is appended to a deque that a reporter thread drains and sends as one batch to the
coordinator: at once when the worker goes idle, else within `flush_s` (1 ms) while it is busy if
another GPU waits for one of them, and within `lazy_s` (50 ms) if none (the coordinator only
counts those: each report is a Ray call, host time the launches would otherwise get).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from disco_ray.graph.errors import RunError, UsageError
from disco_ray.graph.memgraph import HOST, Loc, MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .backend import Backend
from .backend_cpu import CpuBackend
from .plans import (
    K_COPY,
    K_INPUT,
    K_KERNEL,
    K_RELOAD_INPUT,
    K_TRANSFER,
    VertexPlan,
    Views,
    as_tensor,
    describe,
)
from .sanitizer import Sanitizer, granule_for
from .store import State, WorkerStore, source_key
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
    lazy_s: float = 0.05  # longest it holds back the others (only the end of the run waits on them)

    def __post_init__(self) -> None:
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
        self._urgent = False  # an awaited completion is queued
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
        loaded = {p.value for p in self.plans.values() if p.kind in (K_INPUT, K_RELOAD_INPUT)}
        # the caller hands in these at each run; sourced inputs and states are the worker's own
        self.input_values = sorted(x for x in loaded if tg[x].from_caller)
        self._own: dict[str, torch.Tensor] = {}
        self._states: dict[str, State] = {}
        self._acquired: list[str] = []
        try:
            for x in sorted(loaded - set(self.input_values)):
                if tg[x].source is not None:
                    self._own[x] = store.acquire(tg[x])
                    self._acquired.append(x)
                else:
                    self._states[x] = store.state(x, tg[x].nbytes, tg[x].dtype)
                    self._own[x] = self._states[x].buf
            # carried values of this GPU: (value, the vertex holding it at the end, its state)
            self.carries = [
                (value, mg.outputs[value], store.state(key, tg[value].nbytes, tg[value].dtype))
                for value, key in tg.carry.items()
                if tg[value].gpu == gpu
            ]
        except BaseException:
            self._release()
            raise
        self.stable = _stable_loads(mg, gpu, self.plans, set(self._own))
        self._tokens: dict[tuple[int, int], tuple] = {}
        self._skip: frozenset[int] = frozenset()
        # a backend with `stages_inputs` (cuda) gets the graph inputs copied, before each run, into
        # one buffer of its own allocated here (pinned: H2D from it runs at full speed)
        self._stage: dict[str, tuple[int, int]] = {}
        self.staging: torch.Tensor | None = None
        if getattr(self.backend, "stages_inputs", False):
            top = 0
            for name in self.input_values:
                self._stage[name] = (top, self.tg[name].nbytes)
                top += -(-self.tg[name].nbytes // 256) * 256
            self.staging = self.backend.alloc(top, host=True)
        self._lock = threading.Lock()
        self._inputs: dict[str, torch.Tensor] = {}
        self._sanitizer: Sanitizer | None = None
        self._check = False
        self._blocking: set[int] = set()
        self._delay: tuple[float, float] | None = None
        self._rng = random.Random(0)
        self._done_q: collections.deque[int] = collections.deque()
        self._wake = threading.Event()
        self._finished = threading.Event()
        self._closing = False
        self._error: str | None = None
        self.slots = StreamSlots(self.core, streams)
        self.trace: list[tuple[int, int, int, int]] = []
        self.reports = 0
        self.backend.open(streams, self._work, self._done)
        self._reporter = threading.Thread(target=self._report_loop, daemon=True, name=f"reporter-{gpu}")
        self._reporter.start()

    # ---- a run ---------------------------------------------------------------------------------
    def begin(
        self,
        inputs: Mapping[str, torch.Tensor],
        *,
        check: bool = False,
        delay: tuple[float, float] | None = None,
        seed: int = 0,
    ) -> None:
        """Resets the counters for a new run on `inputs` (the caller's tensors this GPU reads)."""
        with self._lock:
            if self.slots.running:
                raise RunError(f"gpu:{self.gpu}: a run is still in progress")
            self._inputs = {}
            for name in self.input_values:
                if name not in inputs:
                    raise RunError(f"gpu:{self.gpu}: input {name!r} was not handed to this worker")
                t = torch.as_tensor(inputs[name])
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                nb = self.tg[name].nbytes  # checked once here, not at every load of it
                if flat.numel() != nb:
                    raise RunError(f"gpu:{self.gpu}: input {name!r} has {flat.numel()} bytes, not {nb}")
                if self.staging is not None:
                    off, _ = self._stage[name]
                    flat = self.staging[off : off + nb].copy_(flat)
                self._inputs[name] = flat
            self._inputs.update(self._own)
            # loads of values the arena still holds from the last run are skipped (actors/store.py)
            slot = self.arena_slot
            self._tokens = {}
            skip = []
            for vid in self.stable:
                p = self.plans[vid]
                x = p.value
                st = self._states.get(x)
                token = ("state", x, st.version) if st is not None else ("source", source_key(self.tg[x]))
                where = (p.out_loc.offset, p.out_loc.nbytes)
                self._tokens[where] = token
                if slot.holds.get(where) == token:
                    skip.append(vid)
            self._skip = frozenset(skip)
            self.store.loads_skipped += len(skip)
            slot.holds = {}  # this run writes the arena: only its own end says what it holds
            if check:
                if self._sanitizer is None:
                    self._sanitizer = Sanitizer(
                        self.gpu,
                        self.arena.numel(),
                        self.host.numel(),
                        self.granule,
                        lambda vid: describe(self.mg, vid),
                    )
                self._sanitizer.reset()
            self._check = check
            # transfers whose pull waits on the host: a one-thread backend runs them aside
            tr = self.transport
            self._blocking = {
                vid
                for vid, p in self.plans.items()
                if p.kind == K_TRANSFER and (tr is None or tr.blocks(p.src_gpu))
            }
            self._delay = delay
            self._rng = random.Random(seed * 7919 + self.gpu)
            # launch ahead is off while the sanitizer runs on a backend that launches
            # asynchronously: its checks run at launch
            self.slots.start(0 if check and getattr(self.backend, "async_launch", False) else self.ahead)
            self.trace = []
            self._done_q.clear()
            self._error = None
            self._finished.clear()
            if self.core.finished:
                self._end_run()

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

    def _pump(self) -> None:
        # caller holds the lock
        if self._error is None:
            blocking = self._blocking
            for vid, s, waits in self.slots.take():
                self.backend.submit(s, vid, waits, vid in blocking)

    @property
    def launched_ahead(self) -> int:
        return self.slots.launched_ahead

    def _work(self, vid: int, s: int) -> None:
        if self._error is not None:  # the run failed: what was launched ahead is skipped
            return
        p = self.plans[vid]
        if self._delay is not None:
            time.sleep(self._rng.uniform(*self._delay))
        san = self._sanitizer if self._check else None
        if san is not None:
            for value, loc, src in p.checks:
                san.check_read(vid, value, loc, src, "before it ran")
            san.begin_write(p.out_loc, vid)
        k = p.kind
        if k == K_KERNEL:
            self.backend.kernel(p.op, p.out, p.ins, p.attrs)
        elif k == K_COPY:
            self.backend.copy(p.out, p.ins[0])
        elif k == K_TRANSFER:
            if self.transport is None:
                raise RunError(f"gpu:{self.gpu}: no transport for {describe(self.mg, vid)}")
            assert p.src_loc is not None  # a transfer's plan has one
            self.transport.pull(p.src_gpu, p.src_loc, p.out, vid, p.src_vid)
        elif vid not in self._skip:
            self.backend.copy(p.out, self._inputs[p.value])

    def _done(self, vid: int, s: int, t0: int, t1: int, exc: BaseException | None) -> None:
        if exc is None and self._check and self._sanitizer is not None:
            p = self.plans[vid]
            try:
                for value, loc, src in p.checks:
                    self._sanitizer.check_read(vid, value, loc, src, "after it ran")
                self._sanitizer.end_write(p.out_loc, vid)
            except RunError as e:
                exc = e
        if exc is not None:
            with self._lock:
                self.slots.landed(vid, s)
            self._fail(vid, exc)
            return
        self.trace.append((vid, s, t0, t1))
        with self._lock:
            self.core.complete(vid)
            self.slots.landed(vid, s)
            self._pump()
            finished = self.core.finished
        if finished:
            self._end_run()
        self._done_q.append(vid)
        if vid in self.core.awaited:  # another GPU waits for it: reported within flush_s
            self._urgent = True
        if not self._wake.is_set():
            self._wake.set()

    def _end_run(self) -> None:
        """Every vertex of this GPU is done: saves the carried values as their states and records
        what the arena holds now, then lets `wait` return."""
        try:
            for _, vid, st in self.carries:
                st.buf.copy_(self.views.buf(self.mg.vertex(vid).out, vid))
                st.version += 1
            if self._error is None:
                self.arena_slot.holds = self._tokens
        except BaseException as e:
            self._fail(None, RunError(f"gpu:{self.gpu}: saving the carried states failed: {e}"))
        self._finished.set()

    def _release(self) -> None:
        for x in self._acquired:
            self.store.release(self.tg[x])
        self._acquired = []

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
        self._finished.set()
        if self._fail_cb is not None:
            self._fail_cb(self.gpu, vid, msg)

    def _report_loop(self) -> None:
        q = self._done_q
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                return
            sent = time.perf_counter()
            while True:
                n = len(q)
                busy = self.slots.running and self._error is None
                # a completion another GPU waits for goes within flush_s; the others (the
                # coordinator only counts them) wait up to lazy_s while the worker is busy:
                # each report is a Ray call, host time taken from launching
                if n and (self._urgent or not busy or time.perf_counter() - sent >= self.lazy_s):
                    self._urgent = False
                    batch = [q.popleft() for _ in range(n)]
                    self.reports += 1
                    sent = time.perf_counter()
                    try:
                        if self._report is not None:
                            self._report(self.gpu, batch)
                    except Exception as e:
                        self._fail(None, RunError(f"gpu:{self.gpu}: reporting completions failed: {e}"))
                if not busy:
                    break
                time.sleep(self.flush_s)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every vertex of this GPU completed or the run failed."""
        return self._finished.wait(timeout)

    @property
    def error(self) -> str | None:
        return self._error

    def read_range(self, loc: Loc, reader: int, expect: int, into: torch.Tensor | None = None):
        """Bytes of `loc` (this GPU's arena or host store), checked by the sanitizer when it is on.

        Copies into `into` when given; otherwise returns a fresh numpy copy (what a Ray call
        ships; the only allocation during a run, on the cpu transport).
        """
        src = self.views.buf(loc, reader)
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
            "streams": self.streams,
            "ahead": self.ahead,
            "launched_ahead": self.launched_ahead,
            "arena_bytes": self.arena.numel(),
            "host_bytes": self.host.numel(),
            "granule": self.granule,
            "sanitizer_checks": self._sanitizer.checks if self._sanitizer else 0,
            "loads_skipped": len(self._skip),
            "store": self.store.statistics(),
            **({"backend": self.backend.statistics()} if hasattr(self.backend, "statistics") else {}),
        }

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self.backend.close()
        self._reporter.join(timeout=5)
        self._release()


def _stable_loads(mg: MemGraph, gpu: int, plans: Mapping[int, VertexPlan], own: set[str]) -> list[int]:
    """The input loads of values in `own` (sourced inputs, states) whose arena range no other
    vertex of this GPU writes: at the end of a run the range still holds the value."""
    writes = sorted(
        (p.out_loc.offset, p.out_loc.end, vid)
        for vid, p in plans.items()
        if p.out_loc.device == gpu and p.out_loc.nbytes > 0
    )
    out = []
    reach = -1  # the furthest end of the ranges before this one
    for n, (off, end, vid) in enumerate(writes):
        p = plans[vid]
        alone = reach <= off and (n + 1 == len(writes) or writes[n + 1][0] >= end)
        if alone and p.kind == K_INPUT and p.value in own:
            out.append(vid)
        reach = max(reach, end)
    return sorted(out)


def make_backend(name: str) -> Backend:
    """The backend called `name` ("cpu"; "cuda" once that backend is added)."""
    if name == "cpu":
        return CpuBackend()
    if name == "cuda":
        try:
            from .backend_cuda import CudaBackend
        except ImportError:
            raise UsageError("backend 'cuda' is not available in this build (use --backend cpu)") from None
        return CudaBackend()
    raise UsageError(f"unknown backend {name!r} (cpu or cuda)")
