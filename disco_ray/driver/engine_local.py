"""The `local` engine: the coordinator core and one Executor per GPU in this process, as threads.

Same cores as the `ray` engine (`actors.scheduler.Scheduler`, `actors.executor.Executor`), with
direct calls instead of actor calls: for debugging, and to measure what Ray costs. A `LocalPool`
plays the part of the Ray engine's `RayPool`: the per-GPU stores (arena, resident inputs,
states) that several engines of one model share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from actors.backends import make_backend
from actors.executor import Executor
from actors.options import DEFAULT_RUN, DEFAULT_WORKER, RunOptions, WorkerConfig
from actors.scheduler import Abort, Completed, Dispatch, Finished, Instruction, Scheduler, WorkerFailed
from actors.steps import loop_steps
from actors.tiers.store import WorkerStore
from actors.transports.base import Transport
from actors.transports.local import LocalTransport
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.taskgraph import TaskGraph


class LocalPool:
    """One `WorkerStore` per GPU, shared by the local engines made with this pool."""

    generation = 0  # never discarded: its stores live as long as it

    def __init__(self) -> None:
        self.stores: dict[int, WorkerStore] = {}
        self.lock = threading.RLock()  # one request at a time, as `RayPool.lock`

    def store(self, gpu: int, backend: str) -> WorkerStore:
        s = self.stores.get(gpu)
        if s is None:
            b = make_backend(backend)
            s = self.stores[gpu] = WorkerStore(gpu, b.alloc, b.stages_inputs)
        return s

    def read_state(self, gpu: int, id: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        if gpu not in self.stores:
            raise RunError(f"the pool has no worker for gpu:{gpu}")
        return self.stores[gpu].read_state(id, tuple(shape), dtype)

    def write_state(self, gpu: int, id: str, value: torch.Tensor) -> None:
        if gpu not in self.stores:
            raise RunError(f"the pool has no worker for gpu:{gpu}")
        self.stores[gpu].write_state(id, value)

    def clear_states(self) -> None:
        for s in self.stores.values():
            s.clear_states()

    def move_states(self, renames: Mapping[str, str], drop: Sequence[str] = ()) -> list[dict]:
        """Renames and drops states on every worker, no data copied (`WorkerStore.move_states`)."""
        return [s.move_states(dict(renames), list(drop)) for s in self.stores.values()]

    def state_count(self) -> list[int]:
        """How many states each worker holds."""
        return [len(s.states) for s in self.stores.values()]

    def close(self) -> None:
        self.stores.clear()


class LocalEngine:
    """Runs a MemGraph with threads; reusable for many runs until `close`."""

    name = "local"
    stale = False

    def __init__(
        self,
        tg: TaskGraph,
        mg: MemGraph,
        *,
        config: WorkerConfig = DEFAULT_WORKER,
        pool: LocalPool | None = None,
        transports: Callable[[list[Executor]], list[Transport]] | None = None,
        **_: object,
    ):
        """`transports`: makes each GPU's transport from the (not yet filled) list of executors;
        default: one `LocalTransport` (a direct copy). Tests put the CUDA transports here, on the
        stand-in device and NCCL."""
        self.tg, self.mg = tg, mg
        self.pool = LocalPool() if pool is None else pool
        self.sched = Scheduler(mg)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: str | None = None
        self.execs: list[Executor] = []
        n = mg.gpus
        self.transports = {f"{i}-{j}": "local" for i in range(n) for j in range(i + 1, n)}
        made = transports(self.execs) if transports is not None else [LocalTransport(self.execs)] * n
        self.pool.lock.acquire()  # the executors allocate in the stores: not during another's run
        try:
            for g in range(mg.gpus):
                self.execs.append(
                    Executor(
                        g,
                        mg,
                        tg,
                        config,
                        transport=made[g],
                        report=self._report,
                        fail=self._fail,
                        store=self.pool.store(g, config.backend),
                    )
                )
                made[g].attach(self.execs[g])
        except BaseException:
            self.close()
            raise
        finally:
            self.pool.lock.release()

    def _report(self, gpu: int, vids: list[int]) -> None:
        with self._lock:
            instrs = self.sched.handle(Completed(gpu, vids))
        self._apply(instrs)

    def _fail(self, gpu: int, vid: int | None, message: str) -> None:
        with self._lock:
            instrs = self.sched.handle(WorkerFailed(gpu, vid, message))
        self._apply(instrs)

    def _apply(self, instrs: list[Instruction]) -> None:
        for i in instrs:
            if isinstance(i, Dispatch):
                self.execs[i.gpu].dispatch(i.vids)
            elif isinstance(i, Finished):
                self._done.set()
            elif isinstance(i, Abort):
                self._error = i.message
                self._done.set()

    def run(
        self, inputs: Mapping[str, torch.Tensor], opts: RunOptions = DEFAULT_RUN
    ) -> tuple[dict[str, torch.Tensor], list[list]]:
        """One run; returns (outputs by TaskGraph id, trace records per GPU)."""
        with self.pool.lock:  # the stores' arena and states serve one run at a time
            return self._run(inputs, opts)

    def _run(
        self, inputs: Mapping[str, torch.Tensor], opts: RunOptions
    ) -> tuple[dict[str, torch.Tensor], list[list]]:
        for ex in self.execs:  # an input left out is the one the worker holds from an earlier run
            ex.begin(
                {k: inputs[k] for k in ex.input_values if k in inputs},
                check=opts.check,
                delay=opts.delay,
                seed=opts.seed,
            )
        self._error = None
        self._done.clear()
        with self._lock:
            instrs = self.sched.start()
        self._apply(instrs)
        progress = opts.progress
        t_end = None if opts.timeout is None else time.monotonic() + opts.timeout
        while not self._done.wait(0.1):
            if progress is not None:
                progress(self.sched.completed)
            if t_end is not None and time.monotonic() > t_end:
                raise RunError(
                    f"run did not finish within {opts.timeout} s "
                    f"({self.sched.completed} of {self.sched.n} vertices done)"
                )
        if self._error is not None:
            raise RunError(self._error)
        if progress is not None:
            progress(self.sched.completed)
        for ex in self.execs:  # every vertex reported done, so each worker has finished too
            ex.wait()
        outs = {}
        for value in self.tg.outputs:  # carried values stay with their workers
            vid = self.mg.outputs[value]
            outs[value] = self.execs[self.mg.vertex(vid).gpu].output(value, vid)
        return outs, [list(ex.trace) for ex in self.execs]

    def run_steps(
        self,
        feeds: Sequence[Mapping[str, torch.Tensor]],
        carry: Mapping,
        halt: Sequence[str],
        opts: RunOptions,
        on_step: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    ) -> tuple[list[dict[str, torch.Tensor]], list[list[list]]]:
        """Up to len(feeds) runs, each step's carried outputs fed to the next (`actors.steps`);
        `on_step(k, outputs)` sees each step's outputs as it ends."""
        return loop_steps(lambda x: self.run(x, opts), feeds, carry, halt, on_step)

    def statistics(self) -> dict:
        return {
            "engine": self.name,
            "scheduler": self.sched.statistics(),
            "workers": [ex.statistics() for ex in self.execs],
        }

    def close(self) -> None:
        with self.pool.lock:  # closing frees store space another thread's run may be using
            # every worker's mappings of its peers' arenas go before any arena (actors/transports/ipc.py)
            for tr in {
                id(ex.transport): ex.transport for ex in self.execs if ex.transport is not None
            }.values():
                tr.close()
            for ex in self.execs:
                ex.close()
