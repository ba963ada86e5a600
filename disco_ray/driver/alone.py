"""The `ray` engine's runs of a one-worker plan, with no coordinator: one call to the worker per
run (`GpuWorker.run_alone`) or per several steps (`GpuWorker.run_steps`, a streaming generator:
each step's outputs reach the driver as that step ends), and the driver's watch over that call
(docs/RUNTIME.md, "One worker" and "Several steps per call").

The coordinator's part in failures is kept here: the driver polls the worker's completions, so
that a dead worker is named with what it held, and the progress and timeout work as in a run
over several workers (`RayEngine._wait`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from actors.options import RunOptions
from disco_ray.graph.errors import RunError

from .watch import HEARTBEAT_S, GcsMonitor, Watchdog


class AloneWatch:
    """The driver's watch over one call to the one worker of engine `eng` (a RayEngine), as the
    coordinator's part in failures would be: a dead or silent worker (no answer for `stall_s`)
    and the timeout (of the whole call) raise RunError naming it; every `poll_s` the worker's
    completions so far give the progress (`RunOptions.progress`)."""

    def __init__(self, eng: Any, opts: RunOptions, poll_s: float, stall_s: float):
        self.eng, self.poll_s = eng, poll_s
        self.progress, self.timeout = opts.progress, opts.timeout
        self.t_end = None if opts.timeout is None else time.monotonic() + opts.timeout
        # the keys of the coordinator's statistics (`Scheduler.statistics`), counted here
        eng._alone = {
            "vertices": len(eng.mg),
            "completed": 0,
            "state": "running",
            "events": 0,
            "dispatch_messages": 0,
            "cross_worker_edges": 0,
            "coordinator": False,
        }
        eng._alone_done = []
        self.dog = Watchdog({0: eng.workers[0]}, HEARTBEAT_S, stall_s)
        self.gcs = GcsMonitor(eng._gcs(), private=eng.pool.private)
        self.asked: Any = None  # the completions asked for at the last poll, not answered yet

    def __enter__(self) -> AloneWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.gcs.__exit__(*exc)

    def next_run(self) -> None:
        """A step of the call ended: the worker counts the next one's completions from 0."""
        self.eng._alone_done, self.asked = [], None

    def until(self, ready: Callable[[float], bool]) -> None:
        """Returns once `ready(poll_s)` (a wait of at most poll_s seconds) says True; raises RunError
        as the class says."""
        import ray

        eng, w = self.eng, self.eng.workers[0]
        while not ready(self.poll_s):
            self.gcs.due()
            if self.asked is not None and ray.wait([self.asked], timeout=0)[0]:
                with contextlib.suppress(Exception):  # dead or failed: the call's ref tells
                    eng._alone_done += ray.get(self.asked)
                self.asked = None
            if self.asked is None:
                self.asked = w.completed_since.remote(len(eng._alone_done))
            silent = self.dog.check()
            if silent is not None:
                raise RunError(
                    f"{eng._name(silent[0])} has not answered for {silent[1]:.0f} s (stopped or "
                    f"hung); the run is abandoned after {eng._progress()} of {len(eng.mg)} vertices"
                )
            if self.progress is not None:
                self.progress(len(eng._alone_done))
            if self.t_end is not None and time.monotonic() > self.t_end:
                raise RunError(
                    f"run did not finish within {self.timeout} s ({eng._progress()} of {len(eng.mg)} "
                    "vertices done)"
                )

    def get(self, ref: Any, cause: Callable[[Exception], str]) -> Any:
        """ray.get(ref) of the call: a task error raises RunError (its message: `cause`), a dead
        worker RunError naming it and what it held."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(ref)
        except RayTaskError as e:
            raise RunError(cause(e)) from None
        except RayActorError:
            raise RunError(self.eng._died(0)) from None


def await_alone(
    eng: Any, ref: Any, opts: RunOptions, poll_s: float, stall_s: float, cause: Callable[[Exception], str]
) -> Any:
    """What the one worker's call `ref` of engine `eng` (a RayEngine) returns, watched
    (`AloneWatch`: its poll_s, stall_s; `cause`: a task error's message)."""
    import ray

    with AloneWatch(eng, opts, poll_s, stall_s) as watch:
        watch.until(lambda t: bool(ray.wait([ref], timeout=t)[0]))
        return watch.get(ref, cause)


def run_steps_alone(
    eng: Any,
    feeds: Sequence[Mapping[str, torch.Tensor]],
    carry: Mapping,
    halt: Sequence[str],
    opts: RunOptions,
    ship: Callable[[torch.Tensor], Any],
    on_step: Callable[[int, dict[str, torch.Tensor]], None] | None,
    poll_s: float,
    stall_s: float,
    cause: Callable[[Exception], str],
) -> tuple[list[dict[str, torch.Tensor]], list[list[list]]]:
    """Steps of a one-worker plan in one call (`GpuWorker.run_steps`, a streaming generator), each
    input as `ship` makes it travel, the call watched as `AloneWatch` (poll_s, stall_s, cause):
    (each step's outputs, each step's trace records per GPU). Each step's outputs go to
    `on_step(k, outputs)` as soon as they arrive, while the worker runs the next step. The
    carried and halt outputs come back with the wanted ones (a carried value the caller does
    not want is still a graph output)."""
    import ray

    wants = eng.wants[0]
    shipped = [{k: ship(feed[k]) for k in wants if k in feed} for feed in feeds]
    gen = eng.workers[0].run_steps.remote(
        eng.key, shipped, opts.check, opts.delay, opts.seed, eng.wanted[0], dict(carry), list(halt)
    )
    outs: list[dict[str, torch.Tensor]] = []
    traces: list[list[list]] = []
    more, err = True, None
    with AloneWatch(eng, opts, poll_s, stall_s) as watch:
        while more:
            try:  # a dead worker makes the generator ready too: its next ref raises ActorDiedError
                watch.until(lambda t: bool(ray.wait([gen], timeout=t)[0]))
                err, part, trace, more = watch.get(next(gen), cause)
            except RunError as e:
                e.step = len(outs)  # the steps before it were delivered
                raise
            traces.append([trace])
            eng._alone["completed"] += len(trace)
            if err is not None:
                break
            outs.append(eng._outputs([part]))
            watch.next_run()
            if on_step is not None:
                on_step(len(outs) - 1, outs[-1])
    eng._alone.update(state="failed" if err else "finished")
    if err is not None:
        failed = RunError(err)
        failed.step = len(outs)  # the steps before it completed
        raise failed
    if opts.progress is not None:
        opts.progress(len(traces[-1][0]))
    return outs, traces
