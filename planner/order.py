"""The serial order V that BUILDMEMGRAPH simulates (TURNIP section 6).

Default heuristic, "finish what you started": a depth-first post-order from the outputs (in the
order they are listed, then any other sinks), visiting a vertex's operands in operand order. Each
operand, a weight say, is scheduled just before its first consumer, and one subtree is finished
before the next starts, which keeps the live set small. Rejected: breadth-first/Kahn order
(loads every level's inputs long before use, so live sets balloon and the planner offloads more).
"""

from __future__ import annotations

from collections.abc import Sequence

from disco_ray.graph.errors import GraphError
from disco_ray.graph.taskgraph import TaskGraph


def default_order(tg: TaskGraph) -> list[str]:
    consumed = {i for v in tg for i in v.inputs}
    kept = tg.kept  # outputs, then carried values
    keep = set(kept)
    roots = kept + [v.id for v in tg if v.id not in consumed and v.id not in keep]
    done: set[str] = set()
    order: list[str] = []
    verts = tg.vertices
    for root in roots:
        if root in done:
            continue
        stack = [(root, 0)]
        while stack:
            vid, i = stack[-1]
            ins = verts[vid].inputs
            while i < len(ins) and ins[i] in done:
                i += 1
            if i < len(ins):
                stack[-1] = (vid, i + 1)
                # a vertex is pushed once per path at most; acyclicity makes the walk finite
                stack.append((ins[i], 0))
            else:
                stack.pop()
                if vid not in done:
                    done.add(vid)
                    order.append(vid)
    return order


def check_order(tg: TaskGraph, order: Sequence[str]) -> list[str]:
    """Validates a user-given order: a permutation of the vertices that respects every edge."""
    order = list(order)
    seen: set[str] = set()
    for vid in order:
        if vid not in tg:
            raise GraphError(f"order: unknown vertex {vid!r}")
        if vid in seen:
            raise GraphError(f"order: vertex {vid!r} listed twice")
        for i in tg[vid].inputs:
            if i not in seen:
                raise GraphError(f"order: vertex {vid!r} comes before its input {i!r}")
        seen.add(vid)
    if len(order) != len(tg):
        missing = next(v.id for v in tg if v.id not in seen)
        raise GraphError(f"order: vertex {missing!r} is missing ({len(order)} of {len(tg)} listed)")
    return order
