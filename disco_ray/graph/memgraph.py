"""MemGraph: the dependency DAG the planner hands out (FORMATS.md, "disco-memgraph").

Every vertex writes one location (a byte range of a GPU arena, or of the host store or the spill
file of the GPU it runs on) and reads values at known locations; edges are data and memory dependencies. Any order
that respects the edges computes the same result.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import overload

import numpy as np

from .errors import FormatError, check_header

FORMAT = "disco-memgraph"
VERSION = 1
HOST = -1  # the host store of the GPU the vertex runs on
INPUT = -2  # the caller's own host copy of a graph input (a reload with "src": null)
DISK = -3  # the spill file of the GPU the vertex runs on (offloads when its host store is full)
TIERS = {HOST: "host", DISK: "disk"}  # where an offload writes


class MKind(str, Enum):
    INPUT = "input"
    KERNEL = "kernel"
    TRANSFER = "transfer"
    OFFLOAD = "offload"
    RELOAD = "reload"


def device_name(d: int) -> str:
    return "host" if d == HOST else "input" if d == INPUT else "disk" if d == DISK else f"gpu:{d}"


def parse_device(s: object, where: str) -> int:
    if s == "host":
        return HOST
    if s == "input":
        return INPUT
    if s == "disk":
        return DISK
    if isinstance(s, str) and s.startswith("gpu:") and s[4:].isdigit():
        return int(s[4:])
    raise FormatError(f"{where}: bad device {s!r} (gpu:N, host, disk or input)")


@dataclass(frozen=True, slots=True)
class Loc:
    device: int  # GPU index, HOST, DISK or INPUT
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def overlaps(self, o: Loc) -> bool:
        return self.device == o.device and self.offset < o.end and o.offset < self.end

    def to_dict(self) -> dict:
        return {"device": device_name(self.device), "offset": self.offset, "nbytes": self.nbytes}

    def __reduce__(self):  # pickles without the dataclass's Python-level __getstate__ (a planner part's)
        return Loc, (self.device, self.offset, self.nbytes)


@dataclass(frozen=True, slots=True)
class Read:
    value: str
    src: int | None  # the vertex that wrote it there; None: a graph input's own host copy
    loc: Loc


@dataclass(frozen=True, slots=True)
class MemVertex:
    id: int
    kind: MKind
    value: str
    gpu: int  # where it runs; a transfer runs on (and writes to) its destination GPU
    ins: tuple[Read, ...]
    out: Loc
    # a sum-into kernel: part k of n of an `accumulate` TaskGraph vertex (reads operand k, adds
    # it into the sum's range under a write lock; the first of the group to run writes it)
    acc: tuple[int, int] | None = None
    # a conditional vertex: (the vertex that writes a flag, its column); skipped at run time unless
    # some row of one of these columns is non-zero (FORMATS.md "Conditional vertices")
    when: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict:
        d = {
            "id": self.id,
            "kind": self.kind.value,
            "value": self.value,
            "device": f"gpu:{self.gpu}",
            "ins": [{"value": r.value, "src": r.src, "loc": r.loc.to_dict()} for r in self.ins],
            "out": self.out.to_dict(),
        }
        if self.acc is not None:
            d["accumulate"] = {"part": self.acc[0], "parts": self.acc[1]}
        if self.when:
            d["when"] = [{"src": u, "index": n} for u, n in self.when]
        return d


# Constructors for the planner and the plan reader, which make a vertex and a read per TaskGraph
# vertex (millions): they set the slots directly, skipping the frozen dataclass __init__'s
# object.__setattr__ per field (2x faster). The objects are the same.
_new = object.__new__
_v_id, _v_kind, _v_value, _v_gpu, _v_ins, _v_out, _v_acc, _v_when = (
    getattr(MemVertex, f).__set__ for f in ("id", "kind", "value", "gpu", "ins", "out", "acc", "when")
)
_r_value, _r_src, _r_loc = (getattr(Read, f).__set__ for f in ("value", "src", "loc"))


def new_vertex(
    id: int,
    kind: MKind,
    value: str,
    gpu: int,
    ins: tuple[Read, ...],
    out: Loc,
    acc: tuple[int, int] | None = None,
) -> MemVertex:
    """MemVertex(id, kind, value, gpu, ins, out, acc), made faster (see above)."""
    v = _new(MemVertex)
    _v_id(v, id)
    _v_kind(v, kind)
    _v_value(v, value)
    _v_gpu(v, gpu)
    _v_ins(v, ins)
    _v_out(v, out)
    _v_acc(v, acc)
    _v_when(v, ())
    return v


def new_read(value: str, src: int | None, loc: Loc) -> Read:
    """Read(value, src, loc), made faster (see above)."""
    r = _new(Read)
    _r_value(r, value)
    _r_src(r, src)
    _r_loc(r, loc)
    return r


class Edges(Sequence[tuple[int, int, str]]):
    """A MemGraph's edges (u, w, "data" | "mem") as arrays, in the planner's order: targets
    ascending. A sequence of tuples to every reader (made as they are read); `u`, `w` (int64) and
    `mem` (bool) for those that take columns. Equal to any sequence of the same tuples.
    """

    __slots__ = ("mem", "u", "w")

    def __init__(self, u: np.ndarray, w: np.ndarray, mem: np.ndarray):
        self.u, self.w, self.mem = u, w, mem

    def __len__(self) -> int:
        return len(self.u)

    def __iter__(self) -> Iterator[tuple[int, int, str]]:
        return zip(self.u.tolist(), self.w.tolist(), map(_KINDS.__getitem__, self.mem.tolist()))

    @overload
    def __getitem__(self, i: int) -> tuple[int, int, str]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[int, int, str]]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        return int(self.u[i]), int(self.w[i]), _KINDS[bool(self.mem[i])]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Edges):
            return bool(
                np.array_equal(self.u, other.u)
                and np.array_equal(self.w, other.w)
                and np.array_equal(self.mem, other.mem)
            )
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Edges({len(self)} edges, {int(self.mem.sum())} mem)"


_KINDS = ("data", "mem")


def edge_columns(edges: Sequence[tuple[int, int, str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(u, w, mem) arrays of any edge sequence (an Edges' own)."""
    if isinstance(edges, Edges):
        return edges.u, edges.w, edges.mem
    return (
        np.fromiter((e[0] for e in edges), np.int64, len(edges)),
        np.fromiter((e[1] for e in edges), np.int64, len(edges)),
        np.fromiter((e[2] == "mem" for e in edges), bool, len(edges)),
    )


@dataclass(slots=True)
class MemGraph:
    """Vertices in a topological order (the planner's: a good priority for the runtime)."""

    capacity: list[int]  # arena bytes per GPU
    vertices: list[MemVertex]
    edges: Sequence[tuple[int, int, str]]  # (u, w, "data" | "mem"): w may not start before u ends
    outputs: dict[str, int]  # TaskGraph output id -> vertex holding its final value
    host_capacity: list[int] = field(default_factory=list)  # host store bytes per GPU
    stats: dict = field(default_factory=dict)
    disk_capacity: list[int] = field(default_factory=list)  # spill-file bytes per GPU
    _index: dict[int, int] | None = field(default=None, compare=False, repr=False)
    # id() of the TaskGraph this process's planner built it from (never saved): a Program trusts
    # such a plan; any other (a file, a hand-made or edited one) is verified first
    _planned_for: int | None = field(default=None, init=False, compare=False, repr=False)  # not copied

    def __post_init__(self) -> None:
        if len(self.disk_capacity) < len(self.capacity):  # none given: no spill file
            self.disk_capacity = [*self.disk_capacity, *[0] * (len(self.capacity) - len(self.disk_capacity))]

    @property
    def gpus(self) -> int:
        return len(self.capacity)

    def __len__(self) -> int:
        return len(self.vertices)

    def __iter__(self) -> Iterator[MemVertex]:
        return iter(self.vertices)

    def index(self, vid: int) -> int:
        """Position in `vertices` of the vertex with id `vid`."""
        if self._index is None:
            self._index = {v.id: n for n, v in enumerate(self.vertices)}
        return self._index[vid]

    def vertex(self, vid: int) -> MemVertex:
        return self.vertices[self.index(vid)]

    def preds(self) -> list[list[int]]:
        """Predecessor positions of each vertex position (duplicates removed)."""
        out: list[set[int]] = [set() for _ in self.vertices]
        for u, w, _ in self.edges:
            out[self.index(w)].add(self.index(u))
        return [sorted(s) for s in out]

    def succs(self) -> list[list[int]]:
        out: list[set[int]] = [set() for _ in self.vertices]
        for u, w, _ in self.edges:
            out[self.index(u)].add(self.index(w))
        return [sorted(s) for s in out]

    def statistics(self) -> dict:
        kinds = {k.value: 0 for k in MKind}
        for v in self.vertices:
            kinds[v.kind.value] += 1
        data = len(self.edges) - int(edge_columns(self.edges)[2].sum())
        return {
            **self.stats,
            "vertices": len(self.vertices),
            "by_kind": kinds,
            "edges": len(self.edges),
            "data_edges": data,
            "mem_edges": len(self.edges) - data,
            "capacity": list(self.capacity),
            "host_capacity": list(self.host_capacity),
            "disk_capacity": list(self.disk_capacity),
        }

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "devices": [
                {
                    "device": f"gpu:{g}",
                    "capacity": c,
                    "host_capacity": self.host_capacity[g] if g < len(self.host_capacity) else 0,
                    "disk_capacity": self.disk_capacity[g] if g < len(self.disk_capacity) else 0,
                }
                for g, c in enumerate(self.capacity)
            ],
            "vertices": [v.to_dict() for v in self.vertices],
            "edges": [list(e) for e in self.edges],
            "outputs": [{"value": k, "vertex": v} for k, v in self.outputs.items()],
            "stats": self.stats,
        }

    @classmethod
    def from_dict(cls, doc: object) -> MemGraph:
        doc = check_header(doc, "memgraph", FORMAT, VERSION)
        try:
            devs = doc["devices"]
            cap = [0] * len(devs)
            host = [0] * len(devs)
            disk = [0] * len(devs)
            for n, d in enumerate(devs):
                g = parse_device(d["device"], f"devices[{n}]")
                if g < 0 or g >= len(devs):
                    raise FormatError(f"devices[{n}]: device {d['device']!r} out of range")
                cap[g] = int(d["capacity"])
                host[g] = int(d.get("host_capacity", 0))
                disk[g] = int(d.get("disk_capacity", 0))
            verts = []
            seen: set[int] = set()
            for n, r in enumerate(doc["vertices"]):
                where = f"memgraph vertex {r.get('id', n)!r}"
                vid = r["id"]
                if not isinstance(vid, int) or isinstance(vid, bool):
                    raise FormatError(f"{where}: id must be an integer")
                if vid in seen:
                    raise FormatError(f"{where}: duplicate id")
                seen.add(vid)
                try:
                    kind = MKind(r["kind"])
                except ValueError:
                    raise FormatError(f"{where}: unknown kind {r['kind']!r}") from None
                gpu = parse_device(r["device"], where)
                if gpu < 0:
                    raise FormatError(f"{where}: a vertex runs on a GPU, not {r['device']!r}")
                ins = tuple(Read(i["value"], i["src"], _loc(i["loc"], where)) for i in r["ins"])
                if any(not (x.src is None or type(x.src) is int) for x in ins):
                    raise FormatError(f'{where}: a read\'s "src" must be a vertex id or null')
                if not all(isinstance(x, str) for x in (r["value"], *(x.value for x in ins))):
                    raise FormatError(f'{where}: a "value" must be a TaskGraph id (a string)')
                acc = r.get("accumulate")
                if acc is not None:
                    ok = (
                        isinstance(acc, dict)
                        and all(type(acc.get(k)) is int for k in ("part", "parts"))
                        and 0 <= acc["part"] < acc["parts"]
                    )
                    if not ok or kind is not MKind.KERNEL:
                        raise FormatError(
                            f'{where}: "accumulate" must be {{"part": k, "parts": n}} (0 <= k < n) on a kernel'
                        )
                    acc = (acc["part"], acc["parts"])
                when = r.get("when", [])
                if not isinstance(when, list) or not all(
                    isinstance(c, dict) and type(c.get("src")) is int and type(c.get("index")) is int
                    for c in when
                ):
                    raise FormatError(f'{where}: "when" must be a list of {{"src": vertex id, "index": n}}')
                cond = tuple((c["src"], c["index"]) for c in when)
                verts.append(MemVertex(vid, kind, r["value"], gpu, ins, _loc(r["out"], where), acc, cond))
            edges = []
            for e in doc["edges"]:
                if not (
                    isinstance(e, list)
                    and len(e) in (2, 3)
                    and all(isinstance(x, int) for x in e[:2])
                    and (len(e) == 2 or e[2] in ("data", "mem"))
                ):
                    raise FormatError(f"memgraph: bad edge {e!r}")
                if e[0] not in seen or e[1] not in seen:
                    raise FormatError(f"memgraph: edge {e!r} names an unknown vertex")
                edges.append((e[0], e[1], e[2] if len(e) == 3 else "data"))
            outputs = {o["value"]: o["vertex"] for o in doc["outputs"]}
            if not all(isinstance(k, str) and type(v) is int for k, v in outputs.items()):
                raise FormatError(f"memgraph: bad outputs {doc['outputs']!r}")
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise FormatError(f"memgraph: missing or malformed field {e}") from None
        stats = doc.get("stats") or {}
        if not isinstance(stats, dict):
            raise FormatError('memgraph: "stats" must be an object')
        return cls(cap, verts, edges, outputs, host, dict(stats), disk)


def _loc(d: dict, where: str) -> Loc:
    off = d["offset"]
    nb = d["nbytes"]
    if not isinstance(off, int) or not isinstance(nb, int) or not (0 <= off < 2**62 and 0 <= nb < 2**62):
        raise FormatError(f"{where}: bad location {d!r}")
    return Loc(parse_device(d["device"], where), off, nb)
