"""The `ray` engine: one MemGraph loaded into a pool's actors (`pool.RayPool`: one GpuWorker per
GPU and a Coordinator), run from the driver.

A Program without a pool of its own runs on the process's shared pool (`pool.shared_pool`;
docs/RUNTIME.md, "Start-up").

End detection: the driver `ray.wait`s on the coordinator's `wait` and every worker's long-lived
`serve` together, so a kernel that raises (reported by its worker) and a worker that dies
(its `serve` ref raises ActorDiedError) both end the run within a poll interval, never a hang.
Each `serve` brings back its worker's outputs and trace records. A one-worker plan runs in one
call, `run_alone`, without the coordinator (docs/RUNTIME.md, "One worker").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from actors.options import DEFAULT_RUN, DEFAULT_WORKER, STALL_S, RunOptions, WorkerConfig
from actors.steps import loop_steps
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .alone import await_alone, run_steps_alone
from .placement import PlacementConfig, connect
from .pool import RayPool, shared_pool, ship_own_ops
from .watch import HEARTBEAT_S, GcsMonitor, Watchdog, gcs_address, watched_get

POLL_S = 0.2
ASK_S = 5.0  # longest the driver waits for the coordinator's count of vertices done
SHIP_NUMPY_BYTES = 1 << 16  # caller inputs up to this size travel as numpy bytes (`shippable`)


class RayEngine:
    """One MemGraph loaded into a pool's actors; reusable for many runs until `close`."""

    name = "ray"

    def __init__(
        self,
        tg: TaskGraph,
        mg: MemGraph,
        *,
        config: WorkerConfig = DEFAULT_WORKER,
        op_modules: Sequence[str] = (),
        num_cpus: int | None = None,
        pool: RayPool | None = None,
        placement: PlacementConfig | None = None,
        address: str | None = None,
        **_: object,
    ):
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        self.tg, self.mg = tg, mg
        if pool is None and address is None and placement is None:
            pool = shared_pool(num_cpus)  # Ray and the actors stay for the next Program
        self.own_pool = pool is None
        self.pool = RayPool(num_cpus=num_cpus, placement=placement, address=address) if pool is None else pool
        self.key = self.pool.new_key()
        self.placement_summary: dict | None = None
        self.broken = False
        self.workers: list = []
        self.transports: dict[str, str] = {}  # "i-j" -> the transfer path of that worker pair
        self.fallbacks: dict[str, str] = {}  # "i-j" -> why that pair is left on the object store
        # per plan, once: the caller inputs each worker reads, the (value, vid) outputs it holds
        self.wants: list[list[str]] = [[] for _ in range(mg.gpus)]
        for v in tg.caller_inputs():  # sourced inputs and states are the workers' own
            self.wants[v.gpu].append(v.id)
        self.wanted: list[list[tuple[str, int]]] = [[] for _ in range(mg.gpus)]
        for value in tg.outputs:  # carried values stay on their workers
            vid = mg.outputs[value]
            self.wanted[mg.vertex(vid).gpu].append((value, vid))
        self._gcs_address: tuple[str | None] | None = None
        self._alone: dict | None = None  # the last run_alone's counts (no coordinator counted it)
        self._alone_done: list[int] = []  # the vertices it completed, as last polled
        self.pool.lock.acquire()  # loading allocates in the workers' store: not during another's run
        try:
            self.coord, self.workers = self.pool.acquire(mg.gpus, config.backend, op_modules)
            self.generation = self.pool.generation
            if any(mg.disk_capacity):  # before the load makes the files: a failed one leaves some
                self.pool.disk_dirs.add(config.disk_dir)
            self._get_watched(ship_own_ops(tg, self.workers), when="installing its ops")
            mg_ref, tg_ref = ray.put(mg), ray.put(tg)
            self._get_watched(
                [
                    self.coord.load.remote(self.key, mg_ref, self.workers),
                    *[
                        w.load.remote(
                            self.key,
                            g,
                            mg_ref,
                            tg_ref,
                            self.coord,
                            self.workers,
                            config,
                        )
                        for g, w in enumerate(self.workers)
                    ],
                ],
                when="loading the graph",
            )
            placed = None if self.pool.placed is None else self.pool.placed.info
            self.transports, self.fallbacks, self.placement_summary = connect(
                self.workers, self.key, mg, config.backend, placed
            )
        except (RayActorError, RayTaskError) as e:
            self.broken = True
            self.close()
            raise RunError(f"loading the graph into the workers failed: {_cause(e)}") from None
        except BaseException:
            self.broken = True
            self.close()
            raise
        finally:
            self.pool.lock.release()

    @property
    def stale(self) -> bool:
        """True when the pool's actors were remade since this engine loaded its graph."""
        return self.broken or self.pool.generation != self.generation

    def run(
        self, inputs: Mapping[str, torch.Tensor], opts: RunOptions = DEFAULT_RUN
    ) -> tuple[dict[str, torch.Tensor], list[list]]:
        """One run; returns (outputs by TaskGraph id, trace records per GPU)."""
        try:
            with self.pool.lock:  # a worker serves one run at a time ("a run is still in progress")
                return self._run(inputs, opts)
        except BaseException:
            self.broken = True  # actors may hold a half-done run: the pool remakes them
            raise

    def _run(
        self, inputs: Mapping[str, torch.Tensor], opts: RunOptions
    ) -> tuple[dict[str, torch.Tensor], list[list]]:
        from ray.exceptions import RayActorError, RayTaskError

        if len(self.workers) == 1:
            return self._run_alone(inputs, opts)
        dog = Watchdog({-1: self.coord, **dict(enumerate(self.workers))}, HEARTBEAT_S, opts.stall_timeout)
        try:
            self._get_watched(
                [
                    w.begin.remote(
                        self.key,
                        {k: shippable(inputs[k]) for k in self.wants[g] if k in inputs},  # left out: kept
                        opts.check,
                        opts.delay,
                        opts.seed,
                        opts.timeout,
                    )
                    for g, w in enumerate(self.workers)
                ],
                dog,
            )
            self._get_watched([self.coord.start.remote(self.key)], dog)
        except (RayActorError, RayTaskError) as e:
            pings = {w.ping.remote(): g for g, w in enumerate(self.workers)}
            why = self._dead_worker(pings) or self._dead_coordinator("as the run started")
            raise RunError(why or f"starting the run failed: {_cause(e)}") from None
        done_ref = self.coord.wait.remote()
        # each worker's serve ends with its part: its outputs and trace records come with it
        serving = {w.serve.remote(self.wanted[g]): g for g, w in enumerate(self.workers)}
        pending = [done_ref, *serving]
        with GcsMonitor(self._gcs(), private=self.pool.private) as gcs:
            return self._wait(opts, done_ref, serving, pending, dog, gcs)

    def _run_alone(
        self, inputs: Mapping[str, torch.Tensor], opts: RunOptions
    ) -> tuple[dict[str, torch.Tensor], list[list]]:
        """A run of a one-worker plan: one call (`GpuWorker.run_alone`) carries the inputs, runs
        every vertex and brings back the outputs and trace records; the coordinator is not
        involved (it would dispatch every vertex at start and only count completions)."""
        ref = self.workers[0].run_alone.remote(
            self.key,
            {k: shippable(inputs[k]) for k in self.wants[0] if k in inputs},  # left out: the worker's copy
            opts.check,
            opts.delay,
            opts.seed,
            self.wanted[0],
        )
        err, part, trace = await_alone(self, ref, opts, POLL_S, opts.stall_timeout, _cause)
        self._alone.update(completed=len(trace), state="failed" if err else "finished")  # type: ignore[union-attr]
        if err is not None:
            raise RunError(err)
        if opts.progress is not None:
            opts.progress(len(trace))
        return self._outputs([part]), [trace]

    def run_steps(
        self,
        feeds: Sequence[Mapping[str, torch.Tensor]],
        carry: Mapping,
        halt: Sequence[str],
        opts: RunOptions,
        on_step: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    ) -> tuple[list[dict[str, torch.Tensor]], list[list[list]]]:
        """Up to len(feeds) runs, each step's carried outputs fed to the next (`actors.steps`): a
        one-worker plan's in one call to it (`GpuWorker.run_steps`), a plan over several workers'
        as single runs. Returns each step's outputs and records; `on_step` sees each as it ends."""
        try:
            if len(self.workers) > 1:
                return loop_steps(lambda x: self._run(x, opts), feeds, carry, halt, on_step)
            watch = (POLL_S, opts.stall_timeout, _cause)
            return run_steps_alone(self, feeds, carry, halt, opts, shippable, on_step, *watch)
        except BaseException:
            self.broken = True  # actors may hold a half-done run: the pool remakes them
            raise

    def _outputs(self, parts: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        """The outputs as typed CPU tensors, from each worker's raw bytes."""
        from actors.plans import as_tensor

        outs: dict[str, torch.Tensor] = {}
        for part in parts:
            outs.update({value: as_tensor(data, self.tg[value]) for value, data in part.items()})
        return outs

    def _gcs(self) -> str | None:
        """The GCS address the runs watch (asked once per engine)."""
        if self._gcs_address is None:
            self._gcs_address = (gcs_address(),)
        return self._gcs_address[0]

    def _wait(self, opts: RunOptions, done_ref, serving: dict, pending: list, dog: Watchdog, gcs: GcsMonitor):
        """The driver's loop of a run: the end, a failure, a silent actor, the timeout."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        progress, timeout = opts.progress, opts.timeout
        t_end = None if timeout is None else time.monotonic() + timeout
        ends: dict[int, tuple] = {}  # gpu -> what its serve returned (error, outputs, trace)
        while True:
            ready, _ = ray.wait(pending, num_returns=1, timeout=POLL_S)
            if not ready:
                gcs.due()
            silent = dog.check()
            if silent is not None and done_ref not in ready:
                who, quiet = silent
                raise RunError(
                    f"{self._name(who)} has not answered for {quiet:.0f} s (stopped or hung); the run "
                    f"is abandoned after {self._progress()} of {len(self.mg)} vertices"
                )
            if progress is not None:
                done = self._progress()
                if isinstance(done, int):  # not "?" (a coordinator that did not answer)
                    progress(done)
            if done_ref in ready:
                try:
                    _, err = ray.get(done_ref)
                except RayActorError:
                    raise RunError("the coordinator died during the run") from None
                if err is not None:
                    # a dead worker also makes its peers' transfers fail: name the root cause
                    raise RunError(self._dead_worker(serving) or err)
                break
            for r in ready:
                g = serving[r]
                try:
                    ends[g] = ray.get(r)
                except RayTaskError as e:
                    raise RunError(_cause(e)) from None
                except RayActorError:
                    raise RunError(self._died(g)) from None
                if ends[g][0] is not None:
                    raise RunError(ends[g][0])
                pending.remove(r)
            if t_end is not None and time.monotonic() > t_end:
                raise RunError(
                    f"run did not finish within {timeout} s ({self._progress()} of {len(self.mg)} vertices done)"
                )
        # the workers' ends not in yet (usually on their way: each part ended before the run did)
        rest = {r: g for r, g in serving.items() if g not in ends}
        for g, end in zip(rest.values(), self._gather(rest), strict=True):
            ends[g] = end
            if end[0] is not None:
                raise RunError(end[0])
        order = [ends[g] for g in range(len(self.workers))]
        return self._outputs([part for _, part, _ in order]), [trace for _, _, trace in order]

    def _get_watched(self, refs: list, dog: Watchdog | None = None, when: str = "as the run starts") -> list:
        """ray.get(refs) while the watchdog (default: over every actor, `STALL_S`) listens: an actor
        stopped outside a run (loading the graph, handing over inputs or counts) is named as one
        stopped during it would be."""
        dog = dog or Watchdog({-1: self.coord, **dict(enumerate(self.workers))}, HEARTBEAT_S, STALL_S)
        try:
            return watched_get(refs, dog, self._name, when)
        except BaseException:
            self.broken = True  # a stopped or dead actor: close kills, and sweeps, instead of unloading
            raise

    def _progress(self) -> int | str:
        """Vertices done so far, as the coordinator counts them ("?" when it does not answer); in a
        one-worker run, as the driver last polled them."""
        import ray

        if len(self.workers) == 1:
            return len(self._alone_done)
        try:
            return ray.get(self.coord.progress.remote(), timeout=ASK_S)
        except Exception:  # stopped, dead or slow: the watchdog names it
            return "?"

    def _name(self, who: int) -> str:
        """'gpu:1 worker (actor 3f2a..., pid 1234, on node ...)' or 'the coordinator (actor ..., pid ...)'."""
        actor = self.coord if who < 0 else self.workers[who]
        pids = self.pool.pids
        pid = pids[who + 1] if who + 1 < len(pids) else "?"
        what = "the coordinator" if who < 0 else f"gpu:{who} worker"
        node = "" if who < 0 else self._node_of(who)
        return f"{what} (actor {actor._actor_id.hex()[:12]}, pid {pid}){node}"

    def _gather(self, refs: dict) -> list:
        """ray.get of each ref (ref -> gpu) after the run; a dead worker is named."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        got = []
        for r, g in refs.items():
            try:
                got.append(ray.get(r))
            except RayTaskError as e:
                raise RunError(_cause(e)) from None
            except RayActorError:
                raise RunError(self._died(g, "handing back outputs")) from None
        return got

    def _dead_worker(self, serving: dict) -> str | None:
        """The death message of the first worker whose ref (in `serving`: ref -> gpu) raises
        ActorDiedError, if any; waits up to 1 s for Ray to tell."""
        import ray
        from ray.exceptions import RayActorError

        ready, _ = ray.wait(list(serving), num_returns=len(serving), timeout=1.0)
        for r in ready:
            try:
                ray.get(r)
            except RayActorError:
                return self._died(serving[r])
        return None

    def _dead_coordinator(self, when: str) -> str | None:
        """'the coordinator (...) died <when>' if it no longer answers a ping (1 s), else None."""
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(self.coord.ping.remote(), timeout=1.0)
        except RayActorError:
            self.broken = True
            return f"{self._name(-1)} died {when}"
        except Exception:  # slow, not dead: the caller says what failed
            return None
        return None

    def _died(self, g: int, when: str = "during the run") -> str:
        self.broken = True
        import ray

        if len(self.workers) == 1:  # no coordinator counted: what the last poll had not seen done
            done = set(self._alone_done)
            held: list[int] | None = [v.id for v in self.mg.vertices if v.id not in done]
        else:
            try:
                held = ray.get(self.coord.held_by.remote(g), timeout=5)
            except Exception:
                held = None
        what = (
            "unknown vertices"
            if held is None
            else f"{len(held)} vertices"
            + (f": {held[:20]}{' ...' if len(held) > 20 else ''}" if held else "")
        )
        return f"gpu:{g} worker died {when} while holding {what}{self._node_of(g)}"

    def _node_of(self, g: int) -> str:
        """The text " (on node ID, IP)" when the placement is known."""
        if self.placement_summary is None or g >= len(self.placement_summary["workers"]):
            return ""
        w = self.placement_summary["workers"][g]
        return f" (on node {w['node_id'][:12]}, {w['ip']})"

    def statistics(self) -> dict:
        from ray.exceptions import RayActorError

        refs = {w.statistics.remote(self.key): g for g, w in enumerate(self.workers)}
        first = [] if self._alone is not None else [self.coord.statistics.remote()]
        try:  # a worker killed or stopped between two runs is named as one in a run would be
            got = self._get_watched([*first, *refs], when="after the run")
        except RayActorError:
            raise RunError(self._dead_worker(refs) or "the coordinator died after the run") from None
        sched = got[0] if first else dict(self._alone or {})
        return {"engine": self.name, "scheduler": sched, "workers": got[len(first) :]}

    def close(self) -> None:
        """Unloads the graph from a shared pool's actors; kills them if that fails (a dead or stuck
        worker), and always kills a private pool's."""
        with self.pool.lock:  # unloading frees arena space another thread's run may be using
            self._close()

    def _close(self) -> None:
        import ray

        if self.own_pool:
            self.pool.close(unload=not self.broken)  # a failed run's actors may be stopped or dead
            return
        if not ray.is_initialized() or self.pool.generation != self.generation:
            return  # the actors this engine loaded into are gone already
        if self.broken:  # a failed run: its actors may be stopped or dead, so no unload to wait on
            self.pool.discard()
            return
        try:
            if any(p in ("ipc", "p2p") for p in self.transports.values()):  # peers' mappings first
                from actors.transports.cuda import disconnect_workers

                disconnect_workers(self.workers, self.key, 30)
            ray.get(
                [w.unload.remote(self.key) for w in self.workers] + [self.coord.unload.remote(self.key)],
                timeout=30,
            )
        except Exception:
            self.pool.discard()


def shippable(t: torch.Tensor) -> torch.Tensor | np.ndarray:
    """What a caller's input travels to its worker as: a small one as its raw bytes in a numpy
    array (Ray pickles that in ~5 us, a torch tensor in ~70 us: a decode step's token, position
    and rotary rows), a large one as the tensor (`actors.loads.input_bytes` takes both)."""
    if t.nbytes > SHIP_NUMPY_BYTES or t.device.type != "cpu":
        return t
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _cause(e: Exception) -> str:
    """The message of the exception a Ray task raised (our RunErrors name worker and vertex)."""
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).strip().splitlines()[-1]
