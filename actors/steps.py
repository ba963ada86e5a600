"""Several steps of one plan in one call: run the same plan up to K times, step k on `feeds[k]`
plus the values carried from step k-1 (output A of step k-1 becomes input B of step k), and stop
after the step whose halt output is nonzero, or after K (docs/RUNTIME.md, "Several steps per call").

The loop is the same wherever it runs: inside a worker for a one-worker plan (`iter_alone_steps`:
one Ray call for K steps, each step's outputs streamed back as it ends, the states saved between
steps as between calls), or in the driver
around single runs (`loop_steps`: the local engine, a plan over several workers). Outputs travel
as a worker's raw bytes (numpy uint8) or typed tensors; both are handled here.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from disco_ray.graph.errors import RunError

if TYPE_CHECKING:
    from .executor import Executor

Carry = Mapping[str, Sequence[str]]  # output of step k -> the inputs of step k+1 it becomes
T = TypeVar("T")


def carried(feed: Mapping[str, T], prev: Mapping[str, T] | None, carry: Carry) -> dict[str, T]:
    """Step k's inputs: its feed, and each carried output of step k-1 (`prev`) under its inputs' names."""
    if prev is None:
        return dict(feed)
    out = dict(feed)
    for value, targets in carry.items():
        for x in targets:
            out[x] = prev[value]
    return out


def halted(outs: Mapping[str, Any], halt: Sequence[str]) -> bool:
    """Whether any halt output holds a nonzero element (its bytes: a worker's raw output)."""
    for h in halt:
        x = outs[h]
        if bool(x.any()) if isinstance(x, np.ndarray) else bool(x.ne(0).any()):
            return True
    return False


def loop_steps(
    run: Callable[[dict], tuple[dict, list]],
    feeds: Sequence[Mapping],
    carry: Carry,
    halt: Sequence[str],
    on_step: Callable[[int, dict], None] | None = None,
) -> tuple[list[dict], list[list]]:
    """`run` (one step: inputs -> (outputs, trace records)) up to len(feeds) times: (each step's
    outputs, each step's records), ending after the first step that halts; `on_step(k, outputs)`
    sees each step's outputs as it ends."""
    outs: list[dict] = []
    records: list[list] = []
    for k, feed in enumerate(feeds):
        try:
            got, recs = run(carried(feed, outs[-1] if outs else None, carry))
        except Exception as e:
            e.step = k  # type: ignore[attr-defined]  # which step of the call failed (RunError.step)
            raise
        outs.append(got)
        records.append(recs)
        if on_step is not None:
            on_step(k, got)
        if halted(got, halt):
            break
    return outs, records


def records_array(trace: Sequence[tuple[int, int, int, int]]) -> np.ndarray:
    """Trace records as one int64 array [n, 4] (vid, stream, start ns, end ns): what a worker's reply
    carries, ~10x cheaper to pickle and unpickle than the tuples (`Program.last_steps` reads
    either)."""
    flat = np.fromiter(itertools.chain.from_iterable(trace), dtype=np.int64, count=4 * len(trace))
    return flat.reshape(-1, 4)


def run_alone(
    ex: Executor,
    inputs: Mapping[str, Any],
    wanted: list[tuple[str, int]],
    *,
    check: bool = False,
    delay: tuple[float, float] | None = None,
    seed: int = 0,
) -> tuple[str | None, dict[str, np.ndarray], list[tuple[int, int, int, int]]]:
    """A whole run of a one-GPU plan on `ex`, with no coordinator: every vertex is dispatched at
    once (none has a remote predecessor, so the coordinator's `start` would hand over all of
    them), and the end is this GPU's own. Returns `Executor.result`: one call per run instead of
    a begin, a start, reports and an end call (docs/RUNTIME.md, "One worker")."""
    _start_alone(ex, inputs, check=check, delay=delay, seed=seed)
    return ex.result(wanted)


def _start_alone(ex: Executor, inputs: Mapping[str, Any], **kw: Any) -> None:
    """Begins a run of a one-GPU plan on `ex` with every vertex dispatched (`Executor.begin`'s
    keywords), no coordinator following it."""
    if ex.mg.gpus != 1:
        raise RunError(f"gpu:{ex.gpu}: run_alone needs a one-GPU plan, this one has {ex.mg.gpus}")
    ex.begin(inputs, coordinated=False, **kw)
    ex.dispatch(ex.core.mine)


def iter_alone_steps(
    ex: Executor,
    feeds: Sequence[Mapping[str, Any]],
    wanted: list[tuple[str, int]],
    carry: Carry,
    halt: Sequence[str],
    *,
    check: bool = False,
    delay: tuple[float, float] | None = None,
    seed: int = 0,
) -> Iterator[tuple[str | None, dict[str, np.ndarray], np.ndarray, bool]]:
    """`run_alone` once per feed (a one-GPU plan), each step's result as soon as it is
    made: step k's inputs are `feeds[k]` and step k-1's carried outputs (as raw bytes; the other
    inputs left out are the worker's copies, as between calls); `wanted` must name the carried
    and halt outputs. Yields per step (its error or None, its wanted outputs, its trace records
    as `records_array`, whether another step follows): the last one yielded says False.

    The thread that ends step k (the stream's that ran its last vertex) takes its outputs and
    begins step k+1 itself (`Executor.begin(on_end=...)`), so no hand-over between threads
    separates two steps; then it queues step k's result for the caller's thread, whose work on
    it (a Ray streaming generator's yield, ~0.6 ms to serialize and report) overlaps step k+1's
    kernels instead of contending for the GIL with the work between the steps."""
    out: queue.SimpleQueue = queue.SimpleQueue()

    def start(k: int, prev: dict[str, Any] | None) -> None:
        def ended() -> None:
            try:
                err, part, trace = ex.result(wanted)  # the run has ended: no wait
                more = err is None and k + 1 < len(feeds) and not halted(part, halt)
                try:
                    if more:
                        start(k + 1, part)
                finally:  # once the next step runs: Ray's thread serializes it meanwhile
                    out.put((err, part, trace, more))
            except BaseException as e:  # raised in the caller's thread
                out.put(_Raised(e))

        inputs = carried(feeds[k], prev, carry)
        _start_alone(ex, inputs, check=check, delay=delay, seed=seed + k, on_end=ended)

    start(0, None)
    while True:
        item = out.get()
        if isinstance(item, _Raised):
            raise item.exc
        err, part, trace, more = item
        yield err, part, records_array(trace), more
        if not more:
            return


@dataclass(frozen=True, slots=True)
class _Raised:
    """An exception of a step begun on a stream's thread, on its way to the caller."""

    exc: BaseException
