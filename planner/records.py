"""The planner's bookkeeping: MemGraph vertices under construction, resident values, capacities."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from disco_ray.errors import GraphError
from disco_ray.memgraph import Loc, MKind


class Rec:
    """A MemGraph vertex under construction (ids are provisional until the final sort)."""

    __slots__ = ("alloc_deps", "deps", "gpu", "ins", "key", "kind", "out", "value")

    def __init__(self, kind: MKind, value: str, gpu: int, key: tuple):
        self.kind = kind
        self.value = value
        self.gpu = gpu
        self.key = key
        self.ins: list[tuple[str, int | None, Loc]] = []
        self.out: Loc | None = None
        self.deps: dict[int, str] = {}  # provisional id -> "data" | "mem"
        # memory deps from the current allocation (undone on retraction); made when first needed
        self.alloc_deps: set[int] | None = None


class Inst:
    """A value resident in a GPU arena: written by `src`, read so far by `readers`.

    `dist` is its distance as a victim: the position in V of its next use, or, for an output
    allocated ahead and not yet produced, its own position (INF: an output nobody reads again).
    """

    __slots__ = ("dist", "gpu", "loc", "off", "pos", "produced", "readers", "size", "src", "value")

    def __init__(self, value: str, gpu: int, src: int, loc: Loc, size: int, pos: int, dist: float):
        self.value, self.gpu, self.src, self.loc, self.size = value, gpu, src, loc, size
        self.off = loc.offset
        self.pos = pos
        self.dist = dist
        self.produced = False
        self.readers: list[int] = []


def capacities(capacity: int | Sequence[int] | Mapping[int, int], gpus: int) -> list[int]:
    if isinstance(capacity, Mapping):
        missing = [g for g in range(gpus) if g not in capacity]
        if missing:
            raise GraphError(f"capacity: no capacity given for gpu {missing[0]}")
        caps = [int(capacity[g]) for g in range(gpus)]
    elif isinstance(capacity, int):
        caps = [capacity] * gpus
    else:
        caps = [int(c) for c in capacity]
        if len(caps) != gpus:
            raise GraphError(f"capacity: {len(caps)} values for {gpus} GPUs")
    for g, c in enumerate(caps):
        if c <= 0:
            raise GraphError(f"capacity of gpu {g} must be positive, got {c}")
    return caps
