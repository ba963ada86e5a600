"""The `ray` engine's runs of a one-worker plan, with no coordinator: one call to the worker per
run (`GpuWorker.run_alone`) or per several steps (`GpuWorker.run_steps`), and the driver's watch
over that call (docs/RUNTIME.md, "One worker" and "Several steps per call").

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


def await_alone(
    eng: Any, ref: Any, opts: RunOptions, poll_s: float, stall_s: float, cause: Callable[[Exception], str]
) -> Any:
    """What the one worker's call `ref` of engine `eng` (a RayEngine) returns, watched: a dead or
    silent worker (no answer for `stall_s`), the timeout and a task error (its message: `cause`)
    raise RunError naming it; every `poll_s` the completions so far give the progress."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    w = eng.workers[0]
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
    dog = Watchdog({0: w}, HEARTBEAT_S, stall_s)
    progress, timeout = opts.progress, opts.timeout
    t_end = None if timeout is None else time.monotonic() + timeout
    asked = None  # the completions asked for at the last poll, not answered yet
    with GcsMonitor(eng._gcs(), private=eng.pool.private) as gcs:
        while not ray.wait([ref], num_returns=1, timeout=poll_s)[0]:
            gcs.due()
            if asked is not None and ray.wait([asked], timeout=0)[0]:
                with contextlib.suppress(Exception):  # dead or failed: `ref` tells
                    eng._alone_done += ray.get(asked)
                asked = None
            if asked is None:
                asked = w.completed_since.remote(len(eng._alone_done))
            silent = dog.check()
            if silent is not None:
                raise RunError(
                    f"{eng._name(silent[0])} has not answered for {silent[1]:.0f} s (stopped or "
                    f"hung); the run is abandoned after {eng._progress()} of {len(eng.mg)} vertices"
                )
            if progress is not None:
                progress(len(eng._alone_done))
            if t_end is not None and time.monotonic() > t_end:
                raise RunError(
                    f"run did not finish within {timeout} s ({eng._progress()} of {len(eng.mg)} "
                    "vertices done)"
                )
        try:
            return ray.get(ref)
        except RayTaskError as e:
            raise RunError(cause(e)) from None
        except RayActorError:
            raise RunError(eng._died(0)) from None


def run_steps_alone(
    eng: Any,
    feeds: Sequence[Mapping[str, torch.Tensor]],
    carry: Mapping,
    halt: Sequence[str],
    opts: RunOptions,
    ship: Callable[[torch.Tensor], Any],
    **watch: Any,
) -> tuple[list[dict[str, torch.Tensor]], list[list[list]]]:
    """Steps of a one-worker plan in one call (`GpuWorker.run_steps`), each input as `ship` makes
    it travel, the call watched as `await_alone` (`watch`: its poll_s, stall_s, cause): (each
    step's outputs, each step's trace records per GPU). The carried and halt outputs come back
    with the wanted ones (a carried value the caller does not want is still a graph output)."""
    wants = eng.wants[0]
    shipped = [{k: ship(feed[k]) for k in wants if k in feed} for feed in feeds]
    ref = eng.workers[0].run_steps.remote(
        eng.key, shipped, opts.check, opts.delay, opts.seed, eng.wanted[0], dict(carry), list(halt)
    )
    err, parts, traces = await_alone(eng, ref, opts, **watch)
    eng._alone.update(completed=sum(map(len, traces)), state="failed" if err else "finished")
    if err is not None:
        failed = RunError(err)
        failed.step = len(parts)  # the steps before it completed
        raise failed
    if opts.progress is not None:
        opts.progress(len(traces[-1]))
    return [eng._outputs([part]) for part in parts], [[trace] for trace in traces]
