"""A TaskGraph as flat lists indexed by vertex-list position, built once per plan.

The planner's hot loops (the schedule order, BUILDMEMGRAPH, the bound) index plain lists by int
instead of dicts of Vertex objects by id; a 370k-vertex graph is flattened in about a second.
"""

from __future__ import annotations

from collections.abc import Sequence

from disco_ray.graph.errors import GraphError
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .capacity import ALIGN, aligned


class Dense:
    """Per vertex-list position k: id, kind, GPU, bytes, operands; `index` maps id -> k."""

    __slots__ = ("gpu", "gpus", "ids", "index", "inputs", "kept", "kind", "nbytes", "operands", "tg")

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        verts = list(tg)
        self.gpus = tg.gpus
        self.ids = [v.id for v in verts]
        index = self.index = {vid: k for k, vid in enumerate(self.ids)}
        self.kind = [v.kind for v in verts]
        self.gpu = [v.gpu for v in verts]
        cache: dict[tuple, int] = {}  # (shape, dtype) -> bytes: graphs repeat a few shapes
        nb = []
        for v in verts:
            key = (v.shape, v.dtype)
            b = cache.get(key)
            if b is None:
                b = cache[key] = v.nbytes
            nb.append(b)
        self.nbytes = nb
        get = index.__getitem__
        # operands in operand order (a value may repeat, as in add(x, x)), then distinct
        self.inputs = [tuple(map(get, v.inputs)) if v.inputs else () for v in verts]
        self.operands = [ins if len(ins) < 2 else tuple(dict.fromkeys(ins)) for ins in self.inputs]
        self.kept = [index[x] for x in tg.kept]  # outputs, then carried values

    def __len__(self) -> int:
        return len(self.ids)

    def sizes(self, alignment: int = ALIGN) -> list[int]:
        """Arena bytes of each value (aligned)."""
        return [aligned(nb, alignment) for nb in self.nbytes]

    def needs(self, sizes: list[int]) -> list[tuple[int, int, int]]:
        """(k, gpu, bytes needed there at once) per vertex, as `capacity.vertex_needs` counts them."""
        out = []
        gpu, kind = self.gpu, self.kind
        for k, ops in enumerate(self.operands):
            if kind[k] is Kind.TRANSFER:
                out.append((k, gpu[ops[0]], sizes[ops[0]]))
                out.append((k, gpu[k], sizes[k]))
            else:
                out.append((k, gpu[k], sizes[k] + sum(sizes[i] for i in ops)))
        return out


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
