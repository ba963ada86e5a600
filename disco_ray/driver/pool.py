"""The Ray pool: long-lived actors (a coordinator and one GpuWorker per GPU) and the Ray they run on.

Start-up (docs/RUNTIME.md, "Start-up"): a Program without a pool of its own uses the process's shared pool
(`shared_pool`): Ray and the actors start on the first run and stay for the next Programs, until
`shutdown()` or the interpreter exits. Ray itself is the one this process is connected to, else a
running cluster of this machine (`cluster.running_cluster`: `$RAY_ADDRESS`, `ray start`), else a
private local Ray (with `num_gpus` logical GPUs) shut down with the pool. Each worker asks for one
GPU, or an equal fraction when the cluster has fewer GPUs than the graph, or none when it has
none (cpu backend only). The engine that runs graphs on a pool is `engine_ray.RayEngine`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from actors.options import STALL_S
from disco_ray.graph.errors import RunError
from disco_ray.graph.taskgraph import TaskGraph

from .cluster import connect, running_cluster
from .placement import Placed, PlacementConfig, place, remove
from .watch import HEARTBEAT_S, Watchdog, watched_get

READY_S = 120.0  # the actors' first answer (their process start, imports)
INLINE_BYTES = 1 << 20  # a private Ray's task arguments and results up to this size travel inline
MAX_CONCURRENCY = 32  # actor threads: serve + dispatch + peers' read_range + driver calls
UNLOAD_S = 30.0  # longest a close waits for the workers to unload their graphs
EXIT_S = 5.0  # longest a discard waits for killed workers to exit before removing their spill files
log = logging.getLogger("disco_ray")
_SHARED: RayPool | None = None
_SHARED_LOCK = threading.Lock()  # two threads' first Programs make one shared pool, not two


def shared_pool(num_cpus: int | None = None) -> RayPool:
    """The process's pool for Programs without one: made on first use, kept until `shutdown()`."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = RayPool(num_cpus=num_cpus)
            atexit.register(shutdown)
        return _SHARED


def shutdown() -> None:
    """Closes the shared pool: its actors, and the Ray it started (`disco_ray.shutdown`)."""
    global _SHARED
    pool, _SHARED = _SHARED, None
    if pool is not None:
        pool.close()


class RayPool:
    """Long-lived actors (a coordinator and one GpuWorker per GPU) that hold any number of graphs.

    Starting an actor process costs seconds (Ray worker start + torch import), so a pool can be
    shared by many Programs (tests do; a model's prefill and decode Programs do, and share the
    workers' resident weights and states, `actors.tiers.store`); an engine without one makes a private
    pool and kills it on close. A pool whose actors failed is discarded: they are killed and
    remade on next use, and every engine on them loads its graph again (`generation`).

    One request at a time: `lock` (re-entrant) is held by each run, each load, and by a model's
    whole request (a generation's prefill and decode steps share the workers' KV cache states), so
    a call from another thread waits its turn (docs/RUNTIME.md, "One request at a time").
    """

    def __init__(
        self,
        *,
        op_modules: Sequence[str] = (),
        num_cpus: int | None = None,
        placement: PlacementConfig | None = None,
        address: str | None = None,
    ):
        self.op_modules = tuple(op_modules)
        self.num_cpus = num_cpus
        self.placement = placement or PlacementConfig()
        # a cluster to connect to (disco_ray.driver.cluster.connect); "local": a private Ray even
        # where a running one could be reused; None: reuse one if running, else a private one
        self.address = address
        self.started_ray = False
        self.coord = None
        self.workers: list = []
        self.placed: Placed | None = None
        self.generation = 0  # counts discards: an engine loaded before the last one must reload
        self.pids: list[int] = []  # of the coordinator, then of each worker
        self.private = False  # this pool started a private Ray (its processes are the driver's)
        self.lock = threading.RLock()
        # where the loaded graphs' spill files go (None: a temporary directory): what a killed
        # worker left there is removed once it is gone (`actors.tiers.sweep`)
        self.disk_dirs: set[str | None] = set()
        self._keys = 0

    def new_key(self) -> str:
        """A key under which a graph is loaded into this pool's actors, unique in this pool."""
        self._keys += 1
        return f"g{self._keys}"

    def acquire(self, gpus: int, backend: str = "cpu", op_modules: Sequence[str] = ()):
        """(coordinator, workers[:gpus]), starting Ray and actors as needed."""
        with self.lock:  # two threads' first runs start one set of actors
            return self._acquire(gpus, backend, op_modules)

    def _acquire(self, gpus: int, backend: str, op_modules: Sequence[str]):
        import ray

        from actors.coordinator import Coordinator
        from actors.worker import GpuWorker

        address = self.address if self.address is not None else running_cluster()
        if not ray.is_initialized() and address and address != "local":
            self.coord, self.workers = None, []
            if self.address is None:
                log.info(
                    "using the running Ray cluster at %s (DISCO_RAY_ADDRESS=local starts a private one)",
                    address,
                )
            with keep_sigterm():
                connect(address)
            self.started_ray = True  # close() then only disconnects: the cluster is not ours to stop
        elif not ray.is_initialized():
            self.coord, self.workers = None, []
            log.info("starting a private Ray (a running cluster, e.g. `ray start --head`, is reused)")
            with keep_sigterm():
                start_private_ray(self.num_cpus or os.cpu_count(), gpus)
            self.started_ray = self.private = True
        mods = tuple(dict.fromkeys((*self.op_modules, *op_modules)))
        if len(self.workers) < gpus or mods != self.op_modules:
            self.discard()
            self.op_modules = mods
        if self.coord is None or not self.workers:
            self.discard()
            # one placement-group bundle per GPU; the coordinator on the driver's node (placement.py)
            self.placed = place(
                gpus,
                backend,
                self.placement,
                GpuWorker,
                Coordinator,
                (self.op_modules,),
                max_concurrency=MAX_CONCURRENCY,
            )
            self.coord, self.workers = self.placed.coord, self.placed.workers
            # process ids, to name an actor that stops answering (a stopped process cannot say)
            self.pids = ray.get([a.pid.remote() for a in (self.coord, *self.workers)], timeout=READY_S)
            if backend == "cuda":
                share_devices(self.workers)
        return self.coord, self.workers[:gpus]

    def discard(self) -> None:
        """Kills the actors (after a failure, or to remake them) and removes the spill files the
        workers had open (a killed worker cannot)."""
        import ray

        if ray.is_initialized():
            for a in [*self.workers, *([self.coord] if self.coord is not None else [])]:
                with contextlib.suppress(Exception):  # already dead: nothing to kill
                    ray.kill(a)
            remove(self.placed)
        if self.workers and self.disk_dirs:
            self._remove_spill_files(self.pids[1:])
        if self.coord is not None or self.workers:
            self.generation += 1
        self.coord, self.workers, self.placed = None, [], None

    def _remove_spill_files(self, pids: Sequence[int]) -> None:
        """Once the killed workers `pids` are gone (a file made by one still loading would outlive
        the sweep), removes their spill files from every directory the graphs named."""
        from actors.tiers.sweep import remove_left

        wait_exited(pids, EXIT_S)
        for d in self.disk_dirs:
            for path in remove_left(d, pids):
                log.debug("removed %s, left by a killed worker", path)
        self.disk_dirs = set()

    def read_state(self, gpu: int, id: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A copy of state `id` of GPU `gpu`'s worker (what the runs so far saved there)."""

        if len(self.workers) <= gpu:
            raise RunError(f"the pool has no worker for gpu:{gpu}")
        return self._get([self.workers[gpu].read_state.remote(id, tuple(shape), dtype)], "reading a state")[0]

    def write_state(self, gpu: int, id: str, value: torch.Tensor) -> None:
        """Sets state `id` of GPU `gpu`'s worker (e.g. an adapter's initial weights)."""

        if len(self.workers) <= gpu:
            raise RunError(f"the pool has no worker for gpu:{gpu}")
        self._get([self.workers[gpu].write_state.remote(id, value)], "writing a state")

    def clear_states(self) -> None:
        """Zeroes every worker's states (a new KV cache, say); resident inputs stay."""

        self._get([w.clear_states.remote() for w in self.workers], "clearing the states")

    def move_states(self, renames: Mapping[str, str], drop: Sequence[str] = ()) -> list[dict]:
        """Renames and drops states on every worker, no data copied (`WorkerStore.move_states`)."""

        renames, drop = dict(renames), list(drop)
        return self._get([w.move_states.remote(renames, drop) for w in self.workers], "moving states")

    def state_count(self) -> list[int]:
        """How many states each worker holds."""
        return self._get([w.state_count.remote() for w in self.workers], "counting states")

    def usage(self) -> list[dict[str, int | None]]:
        """Each worker process's resident memory, open file descriptors and threads
        (`actors.worker.process_usage`)."""
        return self._get([w.usage.remote() for w in self.workers], "reading usage")

    def _get(self, refs: list, when: str) -> list:
        """ray.get of calls on the workers, never a hang: one that stops answering is named after
        `STALL_S` and the actors are discarded (a stopped process is of no further use)."""
        pids = self.pids
        dog = Watchdog(dict(enumerate(self.workers)), HEARTBEAT_S, STALL_S)
        try:
            return watched_get(refs, dog, lambda g: f"gpu:{g} worker (pid {pids[g + 1]})", when)
        except RunError:
            self.discard()
            raise

    def close(self, unload: bool = True) -> None:
        """Kills the actors, and shuts Ray down if this pool started it. First, with `unload`,
        the workers unload their graphs: each removes its spill files, on any node (the sweep of
        `discard` reaches this node's only)."""
        import ray

        if unload and self.workers and ray.is_initialized():
            with contextlib.suppress(Exception):  # dead or stopped: killed, and swept, below
                ray.get([w.unload.remote() for w in self.workers], timeout=UNLOAD_S)
        self.discard()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = self.private = False


def wait_exited(pids: Sequence[int], seconds: float) -> None:
    """Waits up to `seconds` until none of `pids` is a live GpuWorker process of this node (a
    worker on another node, or a reused pid, is not waited for)."""
    deadline = time.monotonic() + seconds
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _live_worker(p)]
        if left:
            time.sleep(0.05)


def _live_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"GpuWorker" not in f.read():
                return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no file
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def keep_sigterm():
    """ray.init installs its own SIGTERM handlers (an exit with a stack dump from the node's): one
    the caller set (the CLI's, which ends the run like Ctrl-C with one line) is put back after."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and callable(before):
            signal.signal(signal.SIGTERM, before)


class _QuietTokenNotice(logging.Filter):
    """Drops Ray's "Token authentication is enabled for this Ray cluster" notice: token auth is
    what a private Ray should have (Ray 2.60's default for a new local cluster), and the line
    would come before every run's own output or error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


@contextlib.contextmanager
def loopback_node():
    """Inside it, a `ray.init(address="local", _node_ip_address="127.0.0.1")` keeps 127.0.0.1 as
    the node's address, so Ray binds its servers (GCS, raylet, workers, agents, metrics) to loopback.

    Ray 2.60 turns 127.0.0.1 into the host's reachable address (`services.resolve_ip_for_localhost`)
    unless `ray_constants.ENABLE_RAY_CLUSTER` is off; `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` sets it
    only when Ray is first imported, so it is switched here for the start-up alone (a cluster this
    process connects to later resolves as before)."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def start_private_ray(num_cpus: int | None, gpus: int) -> None:
    """A Ray of this process only, bound to loopback (`loopback_node`: no port of it, metrics
    included, listens on another interface), with token authentication unless RAY_AUTH_MODE says
    otherwise (Ray 2.60's default for a new local cluster), which keeps out other local users."""
    import ray

    quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _QuietTokenNotice) for f in quiet.filters):
        quiet.addFilter(_QuietTokenNotice())
    with loopback_node():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=gpus,
            include_dashboard=False,
            logging_level="WARNING",  # type: ignore[arg-type]  # a level name works; annotated int
            _node_ip_address="127.0.0.1",
            # a run's outputs (a decode step's logits: 128 KB for a 32000-word vocabulary) come back
            # in the call's reply instead of through the object store (1.3 ms less per step)
            _system_config={"max_direct_call_object_size": INLINE_BYTES},
        )


def ship_own_ops(tg: TaskGraph, workers: Sequence) -> list:
    """Registers, in every worker, the ops of one's own that `tg` uses (defined in the driver after
    the built-in op set), so that no worker lacks one; see `disco_ray.graph.kernels.own_ops`.
    Returns the calls' refs, for the caller to wait on (watched)."""
    from ray import cloudpickle

    from disco_ray.graph.kernels import own_ops

    own = own_ops(v.op for v in tg if v.op is not None)
    if not own:
        return []
    blobs = {name: cloudpickle.dumps(d) for name, d in own.items()}
    return [w.install_ops.remote(blobs) for w in workers]


def share_devices(workers: Sequence) -> list[bool]:
    """Gives the workers of each node the same CUDA_VISIBLE_DEVICES (their GPUs together), each
    using its own entry, before CUDA starts in them: CUDA IPC between two GPUs of a node needs
    both visible (actors/transports/cuda.py, "p2p"). Returns, per worker, whether it took effect."""
    import ray

    from actors.transports.cuda import shared_visible

    assigned = ray.get([w.gpu_ids.remote() for w in workers])
    if any(not ids for _, ids in assigned):
        return [False] * len(workers)
    plan = shared_visible(assigned)
    return ray.get([w.share_devices.remote(vis, idx) for w, (vis, idx) in zip(workers, plan, strict=True)])
