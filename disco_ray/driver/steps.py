"""What `Program.run_steps` takes, checked before anything runs: the steps' feeds, the carry map
and the halt outputs (docs/RUNTIME.md, "Several steps per call"; the loop is `actors.steps`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from disco_ray.graph.errors import RunError, UsageError
from disco_ray.graph.reference import check_inputs
from disco_ray.graph.taskgraph import TaskGraph, Vertex


def check_steps(
    tg: TaskGraph,
    feeds: object,
    carry: object,
    halt: object,
    held: Collection[str],
    callers: Sequence[Vertex],
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """The carry map (output -> the inputs it becomes, a name or a list) and the halt outputs,
    normalized, once `feeds` (one input mapping per step) are checked: step 0 as a single run
    (inputs in `held` may be left out), step k > 0 likewise with every input of the earlier steps
    held and without the carried inputs, which step k-1 gives.

    Raises:
        UsageError: a carry or halt that is not an output, an input of another shape or dtype.
        RunError: a step's bad inputs, naming the step (as `Program.run` names them).
    """
    if not isinstance(feeds, Sequence) or not feeds or not all(isinstance(f, Mapping) for f in feeds):
        raise UsageError("run_steps takes a non-empty list of input mappings, one per step")
    if not isinstance(carry, Mapping):
        raise UsageError(f"carry must map an output to the input(s) it becomes, got {type(carry).__name__}")
    outs, inputs = set(tg.outputs), {v.id: v for v in callers}
    norm: dict[str, tuple[str, ...]] = {}
    for value, targets in carry.items():
        if value not in outs:
            raise UsageError(f"carry: {value!r} is not an output of the graph")
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        for x in targets:
            if x not in inputs:
                raise UsageError(f"carry: {x!r} (from {value!r}) is not an input the caller hands in")
            a, b = tg[value], inputs[x]
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise UsageError(
                    f"carry: output {value!r} is {list(a.shape)} {a.dtype}, input {x!r} "
                    f"{list(b.shape)} {b.dtype}"
                )
        norm[value] = targets
    halts = (halt,) if isinstance(halt, str) else tuple(halt)  # type: ignore[arg-type]
    for h in halts:
        if h not in outs:
            raise UsageError(f"halt: {h!r} is not an output of the graph")
    fed = {x for xs in norm.values() for x in xs}
    have = set(held)
    for k, feed in enumerate(feeds):
        if k:
            given = sorted(fed & set(feed))
            if given:
                raise RunError(f"step {k}: inputs {given} are carried from step {k - 1}: leave them out")
        try:
            check_inputs(tg, feed, have | (fed if k else set()), callers)
        except RunError as e:
            raise RunError(f"step {k}: {e}") from None
        have |= set(feed)
    return norm, halts
