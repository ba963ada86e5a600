"""The planner's bookkeeping: MemGraph vertices under construction and resident values."""

from __future__ import annotations

from disco_ray.graph.memgraph import Loc, MKind


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
