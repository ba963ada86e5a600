"""GPU arena capacities: parsing them, and what a TaskGraph needs at the least, tightly or roomily."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from disco_ray.graph.errors import GraphError
from disco_ray.graph.taskgraph import Kind, TaskGraph, Vertex

ALIGN = 256
log = logging.getLogger("disco_ray.planner")


def aligned(nbytes: int, alignment: int = ALIGN) -> int:
    """The bytes a tensor takes in an arena: rounded up to the alignment, never zero."""
    return max(alignment, -(-nbytes // alignment) * alignment)


def vertex_needs(tg: TaskGraph, alignment: int = ALIGN) -> Iterator[tuple[Vertex, int, int]]:
    """(vertex, gpu, bytes it needs there at once): its distinct inputs plus its output; a
    transfer needs its input on the source GPU and its output on the destination."""
    V = tg.vertices
    for v in tg:
        if v.kind is Kind.TRANSFER:
            x = V[v.inputs[0]]
            yield v, x.gpu, aligned(x.nbytes, alignment)
            yield v, v.gpu, aligned(v.nbytes, alignment)
        else:
            own = aligned(v.nbytes, alignment)
            yield v, v.gpu, own + sum(aligned(V[i].nbytes, alignment) for i in dict.fromkeys(v.inputs))


def min_capacity(tg: TaskGraph, alignment: int = ALIGN) -> list[int]:
    """Per GPU, the least capacity any plan works with: what its largest single vertex needs."""
    need = [0] * tg.gpus
    for _, g, n in vertex_needs(tg, alignment):
        need[g] = max(need[g], n)
    return need


def roomy_capacity(tg: TaskGraph, alignment: int = ALIGN) -> list[int]:
    """Per GPU, room for every tensor of that GPU at once (no offload needed; one alignment unit
    for a GPU with no tensor: an arena is never empty)."""
    cap = [alignment if not any(v.gpu == g for v in tg) else 0 for g in range(tg.gpus)]
    for v in tg:
        cap[v.gpu] += aligned(v.nbytes, alignment)
    return cap


@dataclass(frozen=True, slots=True)
class CapacityBounds:
    """Per GPU, the least capacity any plan works with (`min`: the largest vertex fits) and the
    capacity with room for every tensor at once (`roomy`: nothing offloaded; more is no use).

    Unpacks as the pair `least, roomy = bounds`."""

    min: tuple[int, ...]
    roomy: tuple[int, ...]

    @classmethod
    def of(cls, graphs: Iterable[TaskGraph], alignment: int = ALIGN) -> CapacityBounds:
        """The bounds of running each of `graphs` at one capacity: per GPU, the largest of each."""
        tgs = list(graphs)
        if not tgs:
            raise GraphError("capacity bounds of no graph")
        low = [max(col) for col in zip(*(min_capacity(tg, alignment) for tg in tgs))]
        high = [max(col) for col in zip(*(roomy_capacity(tg, alignment) for tg in tgs))]
        return cls(tuple(low), tuple(high))

    def fits(self, capacity: int | Sequence[int]) -> bool:
        """Whether every GPU's `capacity` (one int for all, or one per GPU) is at least its `min`."""
        caps = [capacity] * len(self.min) if isinstance(capacity, int) else list(capacity)
        return len(caps) == len(self.min) and all(c >= m for c, m in zip(caps, self.min))

    def to_dict(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "roomy": list(self.roomy)}

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter((self.min, self.roomy))


def tight_capacity(tg: TaskGraph, fraction: float, alignment: int = ALIGN) -> list[int]:
    """Per GPU, `fraction` of `roomy_capacity`, but at least `min_capacity`.

    A small fraction (e.g. 0.1) forces offloads; the floor keeps every vertex plannable.
    """
    return [
        max(f, aligned(int(fraction * t), alignment))
        for f, t in zip(min_capacity(tg, alignment), roomy_capacity(tg, alignment))
    ]


def capacities(capacity: int | Sequence[int] | Mapping[int, int], gpus: int) -> list[int]:
    """Capacity per GPU from one int for all, a list, or a dict gpu -> bytes."""
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


def rounded(caps: list[int], alignment: int = ALIGN) -> list[int]:
    """`caps` rounded down to the alignment: every range is a multiple of it, so the rest of an
    arena could hold nothing (`log_rounding` says so once the plan is made)."""
    return [c // alignment * alignment for c in caps]


def log_rounding(asked: list[int], caps: list[int], alignment: int = ALIGN) -> None:
    """A message for each GPU whose capacity `rounded` changed."""
    for g, (a, c) in enumerate(zip(asked, caps)):
        if a != c:
            log.info(
                "capacity of gpu %d rounded down from %d to %d bytes (a multiple of the %d-byte alignment)",
                g,
                a,
                c,
                alignment,
            )


def host_capacities(
    host: int | Sequence[int | None] | Mapping[int, int | None] | None, gpus: int
) -> list[int | None]:
    """Host-store budget per GPU from None (unbounded), one int for all, a list or a dict gpu -> bytes
    (an entry None: that GPU's store unbounded; 0: every offload of that GPU goes to disk)."""
    if host is None:
        return [None] * gpus
    if isinstance(host, Mapping):
        caps = [host.get(g) for g in range(gpus)]
    elif isinstance(host, int):
        caps = [host] * gpus
    else:
        caps = list(host)
        if len(caps) != gpus:
            raise GraphError(f"host capacity: {len(caps)} values for {gpus} GPUs")
    out: list[int | None] = []
    for g, c in enumerate(caps):
        if c is not None and (isinstance(c, bool) or int(c) < 0):
            raise GraphError(f"host capacity of gpu {g} must be >= 0, got {c}")
        out.append(None if c is None else int(c))
    return out
