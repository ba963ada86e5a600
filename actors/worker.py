"""GpuWorker: the Ray actor shell of one GPU; all logic is in `actors.executor.Executor`.

A threaded actor (`max_concurrency` > 1): `serve` blocks one thread for the whole run (its
ObjectRef is how the driver notices the actor dying), while `dispatch` (from the coordinator)
and `read_range` (peers pulling transfer sources) run in the others.

It holds any number of graphs at once, each under the key its engine chose, sharing one
`actors.tiers.store.WorkerStore` (the arena, resident inputs, states). Runs are sequential: `begin(key)`
makes that graph the active one, which `dispatch`, `serve`, `read_range`, `outputs` and `trace`
then serve.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray

from disco_ray.graph.errors import RunError

# torch and the executor are imported where used: a process that only holds a handle of this
# actor (the coordinator, a peer) imports this module to rebuild it, and must not pay torch's
# import (seconds) for that
if TYPE_CHECKING:
    import torch

    from disco_ray.graph.memgraph import Loc, MemGraph
    from disco_ray.graph.taskgraph import TaskGraph

    from .executor import Executor
    from .options import WorkerConfig
    from .tiers.store import WorkerStore
    from .transports.base import Transport


def cpu_threads(streams: int, workers: int) -> int:
    """Intra-op threads per kernel on the cpu backend: the host's cores shared by every stream of
    the graph's workers (all counted as on this host: fewer threads, never more, on a cluster)."""
    return max(1, len(os.sched_getaffinity(0)) // (streams * workers))


class GpuWorker:
    """One per GPU; `load` a graph (allocating its arena), run it any number of times, load the next."""

    def __init__(self, op_modules: Sequence[str] = (), torch_threads: int | None = None):
        """`torch_threads`: intra-op threads of each kernel; None: each graph's `cpu_threads`."""
        import torch

        for m in op_modules:
            importlib.import_module(m)
        self.torch_threads = torch_threads
        torch.set_num_threads(torch_threads or 1)
        self.graphs: dict[str, tuple[Executor, Transport]] = {}  # key -> (executor, its transport)
        self.ex: Executor | None = None  # the active graph's
        self.transport: Transport | None = None
        self.store: WorkerStore | None = None
        self.coord: Any = None
        self.device: int | None = None  # the CUDA device index to use (`share_devices`); None: the current

    def ping(self) -> bool:
        return True

    def usage(self) -> dict[str, int | None]:
        """This process's resident memory, open file descriptors and threads (`process_usage`)."""
        return process_usage()

    def pid(self) -> int:
        """This actor's process id (the driver names a stalled actor by it)."""
        return os.getpid()

    def install_ops(self, pickled: Mapping[str, bytes]) -> list[str]:
        """Registers the ops of one's own that a graph uses: name -> (spec, kernel, temporaries)
        of `disco_ray.graph.kernels.own_ops`, each pickled by value where the driver defined it
        (a script, a notebook), by reference to its module otherwise.

        Raises:
            RunError: naming the op whose definition cannot be rebuilt in this process (its module
                is one the driver imported and this worker cannot).
        """
        from ray import cloudpickle

        from disco_ray.graph.kernels import install_ops

        found = {}
        for name, blob in pickled.items():
            try:
                found[name] = cloudpickle.loads(blob)
            except Exception as e:
                raise RunError(
                    f"op {name!r}: this worker cannot load its definition ({type(e).__name__}: {e}); "
                    "define it in a module the workers can import (installed, or on PYTHONPATH before "
                    'Ray starts) and name that module in op_modules=[...] (README, "Your own op")'
                ) from None
        install_ops(found)
        return sorted(found)

    def gpu_ids(self) -> tuple[str, list[str]]:
        """(node id, the GPU ids Ray assigned to this actor)."""
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def share_devices(self, visible: str, index: int) -> bool:
        """Makes this process see `visible` (the GPUs of every worker on its node) and use device
        `index` of it, so CUDA IPC can map a peer GPU's arena (`actors.transports.cuda`). Only
        before CUDA starts here: False (nothing changed) once it has."""
        import torch

        if torch.cuda.is_initialized():
            return False
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        self.device = index
        return True

    def load(
        self,
        key: str,
        gpu: int,
        mg: MemGraph,
        tg: TaskGraph,
        coordinator: Any,
        workers: Sequence[Any],
        config: WorkerConfig,
    ) -> dict:
        """Adds graph `key` (replacing one of that key): the plan of `mg` for GPU `gpu`, its views
        of the shared arena, its host store, and the sourced inputs it names, read now."""
        import torch

        from .backends import make_backend
        from .executor import Executor
        from .tiers.store import WorkerStore
        from .transports.objectstore import RayTransport

        self.unload(key)
        self.coord = coordinator
        if config.backend == "cuda" and self.device is not None:
            torch.cuda.set_device(self.device)  # its own entry of the node's shared device list
        if config.backend == "cpu":
            torch.set_num_threads(self.torch_threads or cpu_threads(config.streams, len(workers)))
        if self.store is None or self.store.gpu != gpu:
            backend = make_backend(config.backend, self.device)
            self.store = WorkerStore(gpu, backend.alloc, backend.stages_inputs)
        if config.backend == "cuda":  # IPC / NCCL peers, opened by `transport_connect` once all have loaded
            from .transports.cuda import CudaTransport

            transport: Transport = CudaTransport(gpu, workers)
        else:
            transport = RayTransport(workers)
        ex = Executor(
            gpu,
            mg,
            tg,
            config,
            backend=make_backend(config.backend, self.device),
            transport=transport,
            report=self._report,
            fail=self._fail,
            store=self.store,
        )
        transport.attach(ex)
        self.graphs[key] = (ex, transport)
        self.ex, self.transport = ex, transport
        return ex.statistics()

    def _graph(self, key: str) -> tuple[Executor, Transport]:
        if key not in self.graphs:
            raise RunError(f"this worker has no graph {key!r} loaded")
        return self.graphs[key]

    def transport_describe(self, key: str) -> dict:
        return self._graph(key)[1].describe()

    def transport_nccl_id(self, key: str) -> Any:
        return self._graph(key)[1].nccl_id()

    def transport_connect(self, key: str, infos: list[dict], paths: dict, nccl_uid: Any) -> dict:
        return self._graph(key)[1].connect(infos, paths, nccl_uid)

    def transport_close(self, key: str) -> None:
        """Closes graph `key`'s peers (their IPC mappings, its NCCL channel): the first step of an
        unload, on every worker before any frees its arena (`disconnect_workers`)."""
        got = self.graphs.get(key)
        if got is not None:
            got[1].close()

    def unload(self, key: str | None = None) -> None:
        """Drops graph `key` (None: every graph; the store with them)."""
        for k in list(self.graphs) if key is None else [key]:
            got = self.graphs.pop(k, None)
            if got is None:
                continue
            ex, transport = got
            transport.close()  # this worker's mappings of its peers' arenas go before its own arena
            ex.close()
            if self.ex is ex:
                self.ex, self.transport = None, None
        if key is None:
            self.store = None

    def read_state(self, id: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        if self.store is None:
            raise RunError(f"this worker has no state {id!r}")
        return self.store.read_state(id, shape, dtype)

    def write_state(self, id: str, value: torch.Tensor) -> None:
        if self.store is None:
            raise RunError(f"this worker has no graph loaded to hold state {id!r}")
        self.store.write_state(id, value)

    def clear_states(self) -> None:
        if self.store is not None:
            self.store.clear_states()

    def move_states(self, renames: dict[str, str], drop: list[str]) -> dict:
        if self.store is None:
            return {"moved": 0, "dropped": 0}
        return self.store.move_states(renames, drop)

    def state_count(self) -> int:
        return 0 if self.store is None else len(self.store.states)

    def _report(self, gpu: int, vids: list[int]) -> None:
        self.coord.report.remote(gpu, vids)  # fire and forget: the coordinator orders nothing by it

    def _fail(self, gpu: int, vid: int | None, message: str) -> None:
        self.coord.fail.remote(gpu, vid, message)

    def begin(
        self,
        key: str,
        inputs: Mapping[str, torch.Tensor],
        check: bool,
        delay,
        seed: int,
        timeout: float | None = None,
    ) -> None:
        """Makes graph `key` the active one and starts its run on `inputs`; `timeout`: the run's,
        which bounds its transport's waits for peers."""
        ex, transport = self._graph(key)
        self.ex, self.transport = ex, transport
        transport.set_timeout(timeout)
        ex.begin(inputs, check=check, delay=delay, seed=seed)

    @ray.method(num_returns=0)  # fire and forget: no return object to make
    def dispatch(self, vids: list[int]) -> None:
        self._ex().dispatch(vids)

    def serve(
        self, wanted: list[tuple[str, int]]
    ) -> tuple[str | None, dict[str, Any], list[tuple[int, int, int, int]]]:
        """Blocks until this GPU's vertices are all done or the run failed: (the error message or
        None, the raw bytes of each wanted output, the trace records), so the end of a run needs
        no call of its own (`finish`)."""
        return self._ex().result(wanted)

    def run_alone(
        self, key: str, inputs: Mapping[str, torch.Tensor], check: bool, delay, seed: int, wanted: list
    ) -> tuple[str | None, dict[str, Any], list[tuple[int, int, int, int]]]:
        """A whole run of one-GPU graph `key` in this call, no coordinator (`actors.steps.run_alone`)."""
        from .steps import run_alone

        ex, transport = self._graph(key)
        self.ex, self.transport = ex, transport
        return run_alone(ex, inputs, wanted, check=check, delay=delay, seed=seed)

    def run_steps(
        self,
        key: str,
        feeds: Sequence[Mapping[str, torch.Tensor]],
        check: bool,
        delay,
        seed: int,
        wanted: list,
        carry: Mapping[str, Sequence[str]],
        halt: Sequence[str],
    ) -> Iterator[tuple[str | None, dict[str, Any], Any, bool]]:
        """Up to len(feeds) runs of one-GPU graph `key` in this call, each step's carried outputs
        fed to the next, ending after a step whose halt output is nonzero; a streaming generator
        (`num_returns="streaming"`): each step's result goes to the caller as it ends
        (`actors.steps.iter_alone_steps`)."""
        from .steps import iter_alone_steps

        ex, transport = self._graph(key)
        self.ex, self.transport = ex, transport
        # the steps run on the worker's stream threads: each yield overlaps the next step
        yield from iter_alone_steps(ex, feeds, wanted, carry, halt, check=check, delay=delay, seed=seed)

    def completed_since(self, n: int) -> list[int]:
        """The vertices this run completed after its first `n` (the driver of a `run_alone` run
        keeps count, to name what a dead worker held)."""
        return [r[0] for r in self._ex().trace[n:]]

    def read_range(self, loc: Loc, reader: int, expect: int):
        return self._ex().read_range(loc, reader, expect)

    def outputs(self, wanted: list[tuple[str, int]]) -> dict[str, Any]:
        """Raw bytes (numpy uint8) of each wanted output: cheaper to ship than tensors."""
        return {value: self._ex().output_bytes(vid) for value, vid in wanted}

    def trace(self) -> list[tuple[int, int, int, int]]:
        return self._ex().trace

    def statistics(self, key: str | None = None) -> dict:
        ex, transport = (self.ex, self.transport) if key is None else self._graph(key)
        if ex is None:
            raise RunError("this worker has no graph loaded")
        out = ex.statistics()
        if transport is not None and (stats := transport.statistics()):
            out["transport"] = stats
        return out

    def call(self, fn, *args):
        """Runs `fn(self, *args)` in this actor (link probes and diagnostics: disco_ray/driver/cluster.py)."""
        return fn(self, *args)

    def _ex(self) -> Executor:
        if self.ex is None:
            raise RunError("this worker has no graph loaded")
        return self.ex


def process_usage() -> dict[str, int | None]:
    """{"rss_bytes", "open_fds", "threads"} of this process, read from /proc/self (Linux; None
    elsewhere): what a leak grows (the soak test compares them across requests)."""
    out: dict[str, int | None] = {"rss_bytes": None, "open_fds": None, "threads": None}
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        out["rss_bytes"] = int(fields["VmRSS"].split()[0]) * 1024  # "123456 kB"
        out["threads"] = int(fields["Threads"])
        out["open_fds"] = len(os.listdir("/proc/self/fd"))
    except (OSError, KeyError, ValueError):  # not Linux
        pass
    return out
