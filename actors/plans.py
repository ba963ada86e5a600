"""What each vertex of one worker does, decided once when a graph is loaded: the torch views of
its operands in the worker's arena and host store (`arena[off:off+n].view(dtype).view(shape)`),
its kind of work, and the reads the sanitizer checks. A run only issues copies and kernels on
these views (TURNIP section 5: no allocation while a graph runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from disco_ray.graph.dtypes import torch_dtype
from disco_ray.graph.errors import RunError
from disco_ray.graph.kernels import IMPLS
from disco_ray.graph.memgraph import DISK, HOST, INPUT, Loc, MemGraph, MemVertex, MKind
from disco_ray.graph.ops import OPS
from disco_ray.graph.taskgraph import TaskGraph


class PlanKind(Enum):
    """What a vertex's work does on its worker."""

    INPUT = 0  # loads a graph input into the arena
    KERNEL = 1  # runs its op
    TRANSFER = 2  # pulls its range from another worker (a transport)
    COPY = 3  # a copy between this worker's arena and host store (offload, reload)
    RELOAD_INPUT = 4  # loads a graph input again (its earlier copy was overwritten)
    SPILL = 5  # an offload to the spill file (reads ins[0], an arena range; writes out_loc on disk)
    UNSPILL = 6  # a reload from it (reads src_loc on disk; writes out, an arena range)


@dataclass(slots=True)
class VertexPlan:
    kind: PlanKind
    value: str
    out: torch.Tensor  # typed view (kernel) or uint8 view (copies)
    out_loc: Loc
    ins: list[torch.Tensor] = field(default_factory=list)
    op: str = ""  # kernel: its op and complete attrs
    attrs: Mapping = field(default_factory=dict)
    src_gpu: int = -1  # transfer: the source GPU, range and writer
    src_loc: Loc | None = None
    src_vid: int = -1
    checks: tuple = ()  # (value, loc, expected writer) of the reads of this worker's own memory


def describe(mg: MemGraph, vid: int) -> str:
    try:
        v = mg.vertex(vid)
    except KeyError:
        return f"vertex {vid}"
    return f"vertex {vid} ({v.kind.value} {v.value!r})"


def as_tensor(data: np.ndarray, tv) -> torch.Tensor:
    """uint8 bytes as a CPU tensor of TaskGraph vertex `tv`'s dtype and shape."""
    if not data.flags.writeable:  # Ray hands back read-only views of its object store
        data = data.copy()
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.view(torch_dtype(tv.dtype)).view(tv.shape)


class Views:
    """Views of GPU `gpu`'s arena and host store for the vertices of `mg` (planned from `tg`)."""

    def __init__(self, gpu: int, mg: MemGraph, tg: TaskGraph, arena: torch.Tensor, host: torch.Tensor):
        self.gpu, self.mg, self.tg, self.arena, self.host = gpu, mg, tg, arena, host

    def buf(self, loc: Loc, vid: int) -> torch.Tensor:
        """The uint8 view of `loc`; RunError naming vertex `vid` if it is not this worker's memory."""
        buf = self.arena if loc.device == self.gpu else self.host if loc.device == HOST else None
        if buf is None:
            raise RunError(f"gpu:{self.gpu} {describe(self.mg, vid)} uses memory of device {loc.device}")
        if loc.end > buf.numel():
            where = "host store" if loc.device == HOST else "arena"
            raise RunError(
                f"gpu:{self.gpu} {describe(self.mg, vid)}: range [{loc.offset}, {loc.end}) lies "
                f"outside the {where} of {buf.numel()} bytes"
            )
        return buf[loc.offset : loc.end]

    def typed(self, loc: Loc, value: str, vid: int) -> torch.Tensor:
        tv = self.tg[value]
        if loc.nbytes != tv.nbytes:
            raise RunError(
                f"gpu:{self.gpu} {describe(self.mg, vid)}: range of {value!r} has {loc.nbytes} "
                f"bytes, the value needs {tv.nbytes}"
            )
        return self.buf(loc, vid).view(torch_dtype(tv.dtype)).view(tv.shape)

    def plan(self, v: MemVertex) -> VertexPlan:
        local = tuple((r.value, r.loc, r.src) for r in v.ins if r.loc.device in (self.gpu, HOST, DISK))
        if v.kind is MKind.KERNEL:
            op = self.tg[v.value].op
            if op is None:
                raise RunError(f"gpu:{self.gpu} {describe(self.mg, v.id)}: its TaskGraph vertex has no op")
            if op not in OPS or op not in IMPLS:
                raise RunError(
                    f"gpu:{self.gpu} {describe(self.mg, v.id)}: op {op!r} is not registered in this "
                    "worker's process: register it (disco_ray.graph.ops.register and "
                    "disco_ray.graph.kernels.impl) in a module the workers can import and name that "
                    'module in op_modules=[...] (README, "Your own op")'
                )
            return VertexPlan(
                PlanKind.KERNEL,
                v.value,
                self.typed(v.out, v.value, v.id),
                v.out,
                [self.typed(r.loc, r.value, v.id) for r in v.ins],
                op,
                OPS[op].full_attrs(self.tg[v.value].attrs),
                checks=local,
            )
        disk = v.kind in (MKind.OFFLOAD, MKind.RELOAD) and len(v.ins) == 1
        disk = disk and DISK in (v.out.device, v.ins[0].loc.device)
        if disk and v.ins[0].loc.nbytes != v.out.nbytes:
            raise RunError(
                f"gpu:{self.gpu} {describe(self.mg, v.id)} moves {v.ins[0].loc.nbytes} bytes into a "
                f"range of {v.out.nbytes}"
            )
        if disk and v.kind is MKind.OFFLOAD:  # to the spill file: reads an arena range
            arena = self.buf(v.ins[0].loc, v.id)
            return VertexPlan(PlanKind.SPILL, v.value, arena, v.out, [arena], checks=local)
        out = self.buf(v.out, v.id)
        rd = v.ins[0] if v.ins else None
        if disk and rd is not None and rd.src is not None:  # from the spill file
            return VertexPlan(
                PlanKind.UNSPILL, v.value, out, v.out, src_loc=rd.loc, src_vid=rd.src, checks=local
            )
        if v.kind is MKind.INPUT:
            return VertexPlan(PlanKind.INPUT, v.value, out, v.out)
        r = v.ins[0]
        if r.loc.nbytes != v.out.nbytes:
            raise RunError(
                f"gpu:{self.gpu} {describe(self.mg, v.id)} moves {r.loc.nbytes} bytes into a range "
                f"of {v.out.nbytes}"
            )
        if v.kind is MKind.TRANSFER:
            src = -1 if r.src is None else r.src
            return VertexPlan(
                PlanKind.TRANSFER, v.value, out, v.out, src_gpu=r.loc.device, src_loc=r.loc, src_vid=src
            )
        if v.kind is MKind.RELOAD and (r.src is None or r.loc.device == INPUT):
            return VertexPlan(PlanKind.RELOAD_INPUT, v.value, out, v.out)
        return VertexPlan(PlanKind.COPY, v.value, out, v.out, [self.buf(r.loc, v.id)], checks=local)
