"""The planner's bookkeeping: MemGraph vertices under construction and resident values."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from disco_ray.graph.memgraph import Loc, MKind, Read

DATA, MEM = False, True  # edge kinds (is it a memory edge?): the MemGraph's "data", "mem"
STEP = 34  # a record's sort key: (step << STEP) | (1 << OWN) for V[step] itself, else (step << STEP) | seq
OWN = 33


class Rec:
    """A MemGraph vertex under construction (ids are provisional until the final sort by `key`).

    `value` is the TaskGraph vertex's list position; `ins` holds, per operand, the resident Inst it
    read, or a (value, src record, location) tuple for a reload. Until the vertex is produced its
    deps are exactly the memory deps of its allocation (data deps come when it executes), so
    undoing the allocation clears them.
    """

    __slots__ = ("acc", "deps", "gpu", "ins", "key", "kind", "out", "value")

    def __init__(self, kind: MKind, value: int, gpu: int, key: int):
        self.kind = kind
        self.value = value
        self.gpu = gpu
        self.key = key
        self.ins: Sequence[Inst | tuple[int, int | None, Loc]] = ()
        self.out: Loc | None = None  # None: retracted, or a phantom (planner.split)
        self.deps: dict[int, bool] = {}  # provisional id -> DATA | MEM
        self.acc: tuple[int, int] | None = None  # a sum-into member: (part, parts)


class Inst:
    """A value resident in a GPU arena: written by record `src`, read so far by `readers`.

    `dist` is its key as a victim (planner.arena): the position in V of its next use, inf for a
    kept value nobody reads again, RESERVED + its position for an output allocated ahead and not
    produced yet. The sum of a sum-into group (an `accumulate`) has `writers`, its members so far
    (src is the latest): every reader, offload or later writer of the range waits for all of them.
    """

    __slots__ = (
        "block",
        "dist",
        "gpu",
        "loc",
        "off",
        "pos",
        "produced",
        "read",
        "readers",
        "size",
        "src",
        "value",
        "writers",
    )

    def __init__(self, value: int, gpu: int, src: int, loc: Loc, size: int, pos: int, dist: float):
        self.value, self.gpu, self.src, self.loc, self.size = value, gpu, src, loc, size
        self.off = loc.offset
        self.pos = pos
        self.dist = dist
        self.produced = False
        self.readers: list[int] = []
        self.read: Read | None = None  # its MemGraph Read, made once when the plan is written
        self.block: object = None  # its arena block (planner.arena.Block)
        self.writers: list[int] | None = None  # a sum-into group's members (records), else None


class Part:
    """One simulation's vertices, numbered (planner.number), and what the MemGraph needs of its GPUs:
    the whole plan's, or a part's of a split one (planner.split).

    `rows`: MemVertex objects, or (id, kind, value, gpu, reads, out, acc) to send, reads as places
    in `table` (value, src id, location), None for the own; `edges`: (u, w, mem) arrays of their edges by
    id, sorted by target; `held`: transfer -> (its row, its preds by id), whose read the part of its
    source made (`xreads`: (transfer, operand, writer id, writer ids of a sum or None, location));
    `outputs`: kept value -> the id of the vertex holding its final value; `peaks`: GPU -> (arena
    peak, host store peak, host store bytes, spill file peak, spill file bytes).
    """

    __slots__ = ("built", "counts", "edges", "gpus", "held", "outputs", "peaks", "rows", "table", "xreads")

    def __init__(
        self,
        rows: list,
        edges: tuple[np.ndarray, np.ndarray, np.ndarray],
        gpus: list[int],
        outputs: dict[int, int],
        peaks: dict[int, tuple[int, int, int, int, int]],
        counts: dict[str, int],
        built: int,
        held: dict[int, tuple[tuple, dict[int, bool]]],
        xreads: list[tuple[int, int, int, tuple[int, ...] | None, Loc]],
        table: list[tuple[int, int | None, Loc]] | None = None,
    ):
        self.rows = rows
        self.edges = edges
        self.gpus = gpus
        self.outputs = outputs
        self.peaks = peaks
        self.counts = counts
        self.built = built
        self.held = held
        self.xreads = xreads
        self.table = table

    def __reduce__(self):  # sent by a forked part (planner.split)
        return Part, (
            self.rows,
            self.edges,
            self.gpus,
            self.outputs,
            self.peaks,
            self.counts,
            self.built,
            self.held,
            self.xreads,
            self.table,
        )
