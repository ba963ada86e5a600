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
import threading
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
    if ex.mg.gpus != 1:
        raise RunError(f"gpu:{ex.gpu}: run_alone needs a one-GPU plan, this one has {ex.mg.gpus}")
    ex.begin(inputs, check=check, delay=delay, seed=seed, coordinated=False)
    ex.dispatch(ex.core.mine)
    return ex.result(wanted)


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
    as `records_array`, whether another step follows): the last one yielded says False."""
    prev: dict[str, Any] | None = None  # step k-1's outputs (raw bytes)
    for k, feed in enumerate(feeds):
        err, part, trace = run_alone(
            ex, carried(feed, prev, carry), wanted, check=check, delay=delay, seed=seed + k
        )
        more = err is None and k + 1 < len(feeds) and not halted(part, halt)
        yield err, part, records_array(trace), more
        if not more:
            return
        prev = part


def in_a_thread(items: Iterator[T]) -> Iterator[T]:
    """`items`, made in a thread of their own: the caller's work on one item (a Ray streaming
    generator's yield: ~0.6 ms to serialize and report on the 2-core box) overlaps the making of
    the next instead of delaying it. An exception of `items` is raised here, after the items
    before it."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    end = object()

    def make() -> None:
        try:
            for item in items:
                q.put(item)
            q.put(end)
        except BaseException as e:  # raised in the caller's thread
            q.put(_Raised(e))

    threading.Thread(target=make, daemon=True, name="steps").start()
    while (item := q.get()) is not end:
        if isinstance(item, _Raised):
            raise item.exc
        yield item


@dataclass(frozen=True, slots=True)
class _Raised:
    """An exception of `in_a_thread`'s items, on its way to the caller."""

    exc: BaseException
