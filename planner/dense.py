"""A TaskGraph as flat lists indexed by vertex-list position, built once per plan.

The planner's hot loops (the schedule order, BUILDMEMGRAPH, the bound) index plain lists by int
instead of dicts of Vertex objects by id; a 370k-vertex graph is flattened in about a second.
`check_order` validates a serial order given by id.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from disco_ray.graph.errors import CapacityError, GraphError
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .capacity import ALIGN


class Dense:
    """Per vertex-list position k: id, kind, GPU, bytes, operands; `index` maps id -> k.

    `sig[k]` numbers the distinct (shape, dtype) pairs, `sigs` lists them.
    """

    __slots__ = (
        "_csr",
        "gpu",
        "gpus",
        "ids",
        "index",
        "inputs",
        "kept",
        "kind",
        "nbytes",
        "operands",
        "sig",
        "sigs",
        "tg",
    )

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        verts = list(tg)
        self.gpus = tg.gpus
        self.ids = [v.id for v in verts]
        index = self.index = {vid: k for k, vid in enumerate(self.ids)}
        self.kind = [v.kind for v in verts]
        self.gpu = [v.gpu for v in verts]
        # (shape, dtype) of each vertex as a small int: graphs repeat a few shapes
        cache: dict[tuple, int] = {}
        self.sigs: list[tuple[tuple[int, ...], str]] = []  # sig -> (shape, dtype)
        sig: list[int] = []
        self.sig = sig
        per_sig: list[int] = []  # sig -> bytes
        for v in verts:
            key = (v.shape, v.dtype)
            s = cache.get(key)
            if s is None:
                s = cache[key] = len(self.sigs)
                self.sigs.append(key)
                per_sig.append(v.nbytes)
            sig.append(s)
        self.nbytes = list(map(per_sig.__getitem__, sig))
        get = index.__getitem__
        # operands in operand order (a value may repeat, as in add(x, x)), then distinct
        self.inputs = [tuple(map(get, v.inputs)) if v.inputs else () for v in verts]
        self.operands = [
            ins if len(ins) < 2 or len(set(ins)) == len(ins) else tuple(dict.fromkeys(ins))
            for ins in self.inputs
        ]
        self.kept = [index[x] for x in tg.kept]  # outputs, then carried values
        self._csr: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def sizes(self, alignment: int = ALIGN) -> list[int]:
        """Arena bytes of each value (`capacity.aligned`: rounded up to the alignment, never zero)."""
        nb = np.asarray(self.nbytes, dtype=np.int64)
        return np.maximum(alignment, -(-nb // alignment) * alignment).tolist()

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct operands of all vertices as arrays: (offsets, operands), vertex k's in [off[k], off[k+1])."""
        if self._csr is None:
            lens = np.fromiter(map(len, self.operands), dtype=np.int64, count=len(self.operands))
            off = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=off[1:])
            flat = np.fromiter(chain.from_iterable(self.operands), dtype=np.int64, count=int(off[-1]))
            self._csr = (off, flat)
        return self._csr

    def needs(self, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(k, gpu, bytes needed there at once) arrays, one row per vertex (two per transfer: its
        source and its destination), as `capacity.vertex_needs` counts them."""
        off, flat = self.csr()
        size = np.asarray(sizes, dtype=np.int64)
        gpu = np.asarray(self.gpu, dtype=np.int64)
        summed = np.concatenate(([0], np.cumsum(size[flat])))
        need = size + summed[off[1:]] - summed[off[:-1]]  # own bytes plus its operands'
        transfer = np.array([k is Kind.TRANSFER for k in self.kind], dtype=bool)
        first = (
            flat[np.minimum(off[:-1], max(len(flat) - 1, 0))] if len(flat) else np.zeros(0, dtype=np.int64)
        )
        ks = np.arange(len(size), dtype=np.int64)
        t = transfer
        return (
            np.concatenate((ks[~t], ks[t], ks[t])),
            np.concatenate((gpu[~t], gpu[first[t]], gpu[t])),  # a transfer needs its source there
            np.concatenate((need[~t], size[first[t]], size[t])),  # and its output here
        )


def check_fits(
    d: Dense,
    needs: tuple[np.ndarray, np.ndarray, np.ndarray],
    room: Sequence[int],
    asked: Sequence[int],
    alignment: int,
) -> None:
    """Raises CapacityError for the first vertex (in list order) whose `needs` row (vertex, gpu,
    bytes: Dense.needs) exceeds its GPU's arena bytes `room` (`asked` before rounding)."""
    ks, gs, need = needs
    bad = np.flatnonzero(need > np.asarray(room, dtype=np.int64)[gs])
    if len(bad):
        i = int(bad[np.argmin(ks[bad])])
        k, g = int(ks[i]), int(gs[i])
        what = "its output" if d.kind[k] is Kind.INPUT else "its inputs plus output"
        cap = int(room[g])
        note = "" if asked[g] == cap else f" ({asked[g]} rounded down to the {alignment}-byte alignment)"
        raise CapacityError(
            f"vertex {d.ids[k]!r}: {what} need {int(need[i])} bytes on gpu {g}, whose capacity is "
            f"{cap} bytes{note}"
        )


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
