"""Several steps of one plan in one call: run the same plan up to K times, step k on `feeds[k]`
plus the values carried from step k-1 (output A of step k-1 becomes input B of step k), and stop
after the step whose halt output is nonzero, or after K (docs/RUNTIME.md, "Several steps per call").

The loop is the same wherever it runs: inside a worker for a one-worker plan (`run_alone_steps`:
one Ray call for K steps, the states saved between steps as between calls), or in the driver
around single runs (`loop_steps`: the local engine, a plan over several workers). Outputs travel
as a worker's raw bytes (numpy uint8) or typed tensors; both are handled here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

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
    run: Callable[[dict], tuple[dict, list]], feeds: Sequence[Mapping], carry: Carry, halt: Sequence[str]
) -> tuple[list[dict], list[list]]:
    """`run` (one step: inputs -> (outputs, trace records)) up to len(feeds) times: (each step's
    outputs, each step's records), ending after the first step that halts."""
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
        if halted(got, halt):
            break
    return outs, records


def records_array(trace: Sequence[tuple[int, int, int, int]]) -> np.ndarray:
    """Trace records as one int64 array [n, 4] (vid, stream, start ns, end ns): what a worker's reply
    carries, ~10x cheaper to pickle and unpickle than the tuples (`Program.last_steps` reads
    either)."""
    flat = np.fromiter(itertools.chain.from_iterable(trace), dtype=np.int64, count=4 * len(trace))
    return flat.reshape(-1, 4)


def run_alone_steps(
    ex: Executor,
    feeds: Sequence[Mapping[str, Any]],
    wanted: list[tuple[str, int]],
    carry: Carry,
    halt: Sequence[str],
    *,
    check: bool = False,
    delay: tuple[float, float] | None = None,
    seed: int = 0,
) -> tuple[str | None, list[dict[str, np.ndarray]], list[np.ndarray]]:
    """`Executor.run_alone` once per feed in this call (a one-GPU plan): step k's inputs are
    `feeds[k]` and step k-1's carried outputs (as raw bytes; the other inputs left out are
    the worker's copies, as between calls); `wanted` must name the carried and halt outputs.
    Returns (the first error or None, each step's wanted outputs, each step's trace records as
    `records_array`)."""
    parts: list[dict[str, np.ndarray]] = []
    traces: list[np.ndarray] = []
    for k, feed in enumerate(feeds):
        inputs = carried(feed, parts[-1] if parts else None, carry)
        err, part, trace = ex.run_alone(inputs, wanted, check=check, delay=delay, seed=seed + k)
        traces.append(records_array(trace))
        if err is not None:
            return err, parts, traces
        parts.append(part)
        if halted(part, halt):
            break
    return None, parts, traces
