"""The values of a captured torch program as TaskGraph vertices, and how they move between GPUs.

A `Value` is one tensor of the exported program. It is held in one of these forms, and `Graph`
turns any of them into a whole tensor on a given GPU when an op needs one (`Graph.on`):

- whole: `copies` maps a GPU to the id of the whole tensor there (a transfer makes a replica, once);
- split: `parts` cut one axis (`axis`: the last for a column-parallel linear's output, the
  channels for a convolution split by output channels) into ranges held on different GPUs; made
  whole by a concat of the parts, each transferred where needed;
- partial: `partial` lists summands on different GPUs (a row-parallel linear's output; made
  whole by transfers and one add);
- weight: a parameter, buffer or constant, read by name (`weights.Weights`) as a graph input on
  the GPU that uses it, whole or a block of it;
- view: a reshape, permute or slice of another value, materialised only when an op reads it, with
  consecutive reshapes merged and consecutive permutes composed (a torch view costs nothing; a
  vertex here is a copy, so a chain of views should cost as few as possible, and a piece of a
  split nobody reads costs nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disco_ray.graph.taskgraph import TaskGraph

from .weights import Weights


@dataclass(frozen=True, slots=True)
class Part:
    gpu: int
    id: str
    lo: int  # the part's range [lo, hi) of the last axis
    hi: int


@dataclass(eq=False, slots=True)
class Value:
    shape: tuple[int, ...]
    dtype: str
    name: str  # the exported program's node name: the stem of this value's vertex ids
    copies: dict[int, str] = field(default_factory=dict)
    parts: tuple[Part, ...] = ()
    axis: int = -1  # the axis `parts` cut
    partial: tuple[tuple[int, str], ...] = ()
    weight: str | None = None
    base: Value | None = None  # a view of `base` through `views`
    # ("reshape", shape) / ("permute", dims) / ("slice", (axis, start, stop))
    views: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def split(self) -> bool:
        return bool(self.parts) and not self.copies

    @property
    def last_split(self) -> bool:
        """Split along the last axis (a linear layer's features)."""
        return self.split and self.axis in (-1, len(self.shape) - 1)

    @property
    def summed(self) -> bool:
        return bool(self.partial) and not self.copies


def fold_views(shape: tuple[int, ...], views) -> list[tuple[str, tuple[int, ...]]]:
    """The fewest copies that apply `views` to a tensor of `shape`: consecutive reshapes merge,
    consecutive permutes compose, and a reshape to the current shape or identity permute drops."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for kind, arg in views:
        if out and out[-1][0] == kind == "reshape":
            out[-1] = ("reshape", arg)
        elif out and out[-1][0] == kind == "permute":
            prev = out[-1][1]
            out[-1] = ("permute", tuple(prev[d] for d in arg))
        else:
            out.append((kind, arg))
    kept: list[tuple[str, tuple[int, ...]]] = []
    cur = shape
    for kind, arg in out:
        if kind == "reshape" and arg == cur:
            continue
        if kind == "permute" and arg == tuple(range(len(arg))):
            continue
        if kind == "slice" and (arg[1], arg[2]) == (0, cur[arg[0]]):
            continue
        if kind == "reshape":
            cur = arg
        elif kind == "permute":
            cur = tuple(cur[d] for d in arg)
        else:
            cur = tuple(arg[2] - arg[1] if d == arg[0] else n for d, n in enumerate(cur))
        kept.append((kind, arg))
    return kept


def _attrs(kind: str, arg: tuple[int, ...]) -> dict:
    if kind == "reshape":
        return {"shape": list(arg)}
    if kind == "permute":
        return {"dims": list(arg)}
    return {"axis": arg[0], "start": arg[1], "stop": arg[2]}


class Graph:
    """The TaskGraph being built, with the values it holds and how to get them onto a GPU."""

    def __init__(self, gpus: int, weights: Weights):
        self.tg = TaskGraph(gpus=gpus)
        self.weights = weights
        self._ids: set[str] = set()

    def fresh(self, stem: str) -> str:
        """A vertex id not used yet: `stem`, else `stem~2`, `stem~3`, ..."""
        name, n = stem, 1
        while name in self._ids or name in self.tg:
            n += 1
            name = f"{stem}~{n}"
        self._ids.add(name)
        return name

    def kernel(self, op: str, *ins: str, gpu: int, stem: str, **attrs) -> str:
        return self.tg.kernel(op, *ins, gpu=gpu, id=self.fresh(stem), **attrs)

    def whole(self, id: str, gpu: int) -> Value:
        """A Value for vertex `id`, whole on the GPU it lies on."""
        v = self.tg[id]
        return Value(v.shape, v.dtype, id, copies={gpu: id})

    def on(self, v: Value, gpu: int) -> str:
        """The id of `v` whole on `gpu`, made (transfers, a concat, an add, views) once and kept."""
        if gpu in v.copies:
            return v.copies[gpu]
        if v.copies:
            src = min(v.copies)
            got = self.tg.transfer(v.copies[src], gpu, id=self.fresh(f"{v.name}>g{gpu}"))
        elif v.weight is not None:
            got = self.weights.input(self.tg, v.weight, gpu, self.fresh)
        elif v.base is not None:
            got = self.on(v.base, gpu)
            for kind, arg in fold_views(v.base.shape, v.views):
                got = self.kernel(kind, got, gpu=gpu, stem=v.name, **_attrs(kind, arg))
        elif v.parts:
            pieces = [self._moved(p.id, p.gpu, gpu) for p in v.parts]
            got = self.kernel("concat", *pieces, gpu=gpu, stem=v.name, axis=v.axis)
        else:
            pieces = [self._moved(id, g, gpu) for g, id in v.partial]
            got = self.kernel("add", *pieces, gpu=gpu, stem=v.name)
        v.copies[gpu] = got
        return got

    def _moved(self, id: str, src: int, gpu: int) -> str:
        return id if src == gpu else self.tg.transfer(id, gpu, id=self.fresh(f"{id}>g{gpu}"))

    def home(self, v: Value, default: int = 0) -> int:
        """A GPU where `v` already lies whole (the lowest), else `default`."""
        return min(v.copies) if v.copies else default

    def view(self, v: Value, kind: str, arg: tuple[int, ...], shape: tuple[int, ...], name: str) -> Value:
        """`v` reshaped (kind "reshape", arg the new shape), permuted (arg the dims) or sliced (arg
        (axis, start, stop)), lazily."""
        if v.base is not None and not v.copies:
            return Value(shape, v.dtype, name, base=v.base, views=(*v.views, (kind, arg)))
        return Value(shape, v.dtype, name, base=v, views=((kind, arg),))
