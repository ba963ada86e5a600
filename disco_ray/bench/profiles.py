"""Cost models for the simulator: device profiles (rates of a GPU and its links) and the unit model.

A cost model gives each MemGraph vertex a duration; the lane it occupies on its GPU is the runtime's
(`actors.lanes`):
`compute` (kernels), `h2d` (input loads and reloads), `d2h` (offloads), `peer` (GPU-to-GPU
transfers, on the destination GPU), and `disk_w` / `disk_r` (offloads to and reloads from the
worker's spill file: the disk lanes). `h100` holds figures measured on the lent H100 (GPU.md);
`a100`, `p100` and `t4` come from public specifications, derated by `efficiency` for the kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from actors.lanes import Route, route
from disco_ray.graph import ops
from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import DISK, MemVertex, MKind
from disco_ray.graph.taskgraph import Vertex

LANES = tuple(r.value for r in Route)  # compute, h2d, d2h, peer, disk_w, disk_r (actors/lanes.py)


def on_disk(v: MemVertex) -> bool:
    """An offload to or a reload from the spill file."""
    if v.kind is MKind.OFFLOAD:
        return v.out.device == DISK
    return v.kind is MKind.RELOAD and bool(v.ins) and v.ins[0].loc.device == DISK


def lane(v: MemVertex) -> str:
    """The lane (channel) of its GPU that vertex `v` occupies while it runs: the runtime's rule."""
    return route(v).value


def kernel_work(tv: Vertex, in_shapes: list[tuple[int, ...]]) -> float:
    """Floating-point operations of TaskGraph kernel `tv` (0 when its op states none)."""
    assert tv.op is not None, f"{tv.id} is an input, not a kernel"
    spec = ops.OPS[tv.op]
    return float(spec.flops(in_shapes, tv.shape, spec.full_attrs(tv.attrs))) if spec.flops else 0.0


@dataclass(frozen=True, slots=True)
class Profile:
    """Rates of one GPU model and its links; kernel time is max(flops / rate, bytes / hbm)."""

    name: str
    flops: Mapping[str, float]  # dtype -> peak FLOP/s of matmul-like kernels
    hbm: float  # GPU memory bytes/s (read + written bytes of a kernel)
    h2d: float  # host-to-GPU bytes/s (pinned)
    d2h: float  # GPU-to-host bytes/s (pinned)
    peer: float  # GPU-to-GPU bytes/s into one GPU
    memory: int  # GPU memory bytes
    launch: float = 10e-6  # fixed cost of every vertex (launch, callback)
    streams: int = 5  # streams per GPU (the papers' runtime uses 5)
    efficiency: float = 1.0  # fraction of peak FLOP/s kernels reach
    op_speed: Mapping[str, float] = field(
        default_factory=dict
    )  # op -> fraction of the rates its kernel reaches
    # the spill file's bytes/s (a generic NVMe drive, not measured; benchmarks/bench_tiers.py
    # measures the disk of the machine it runs on)
    disk_write: float = 2e9
    disk_read: float = 3e9
    ahead: int = 4  # kernels launched ahead per stream: the cuda backend's default
    overlap: bool = False  # one vertex at a time per engine: a kernel's time assumes the whole GPU

    def time(self, v: MemVertex, tv: Vertex | None, in_shapes: list[tuple[int, ...]]) -> float:
        """Seconds vertex `v` occupies its lane (`tv`: its TaskGraph vertex, for kernels)."""
        nb = v.out.nbytes
        if on_disk(v):  # the device copy and the file I/O, one after the other
            if v.kind is MKind.OFFLOAD:
                return self.launch + nb / self.d2h + nb / self.disk_write
            return self.launch + nb / self.disk_read + nb / self.h2d
        if v.kind in (MKind.INPUT, MKind.RELOAD):
            return self.launch + nb / self.h2d
        if v.kind is MKind.OFFLOAD:
            return self.launch + nb / self.d2h
        if v.kind is MKind.TRANSFER:
            return self.launch + nb / self.peer
        assert tv is not None and tv.op is not None  # a kernel: its TaskGraph vertex computes
        speed = self.op_speed.get(tv.op, 1.0)
        rate = self.flops.get(tv.dtype, self.flops["float32"]) * self.efficiency * speed
        moved = nb + sum(r.loc.nbytes for r in v.ins)
        if v.acc is not None:  # a sum-into kernel also reads the sum it adds into
            moved += nb
        return self.launch + max(kernel_work(tv, in_shapes) / rate, moved / (self.hbm * speed))

    def with_(self, **kw) -> Profile:
        """A copy with some fields changed (`h100.with_(streams=2)`)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        return Profile(**{**d, **kw})


@dataclass(frozen=True, slots=True)
class UnitCost:
    """The papers' worked example (DISCO §1): every matmul, load and transfer takes one unit.

    Kernels cost `kernel[op]` (0 for ops not listed); `overrides` gives the duration of every vertex
    computing or moving a given TaskGraph value (the example assumes X(1) is already on the GPUs).
    """

    kernel: Mapping[str, float] = field(default_factory=lambda: {"matmul": 1.0})
    load: float = 1.0  # input load or reload
    offload: float = 1.0
    transfer: float = 1.0
    launch: float = 0.0
    streams: int = 5
    overrides: Mapping[str, float] = field(default_factory=dict)
    name: str = "unit"
    ahead: int = 0  # kernels launched ahead per stream
    overlap: bool = False  # one vertex at a time per engine (one matmul, one load, one transfer)

    def time(self, v: MemVertex, tv: Vertex | None, in_shapes: list[tuple[int, ...]]) -> float:
        if v.value in self.overrides:
            return self.overrides[v.value]
        if v.kind in (MKind.INPUT, MKind.RELOAD):
            base = self.load
        elif v.kind is MKind.OFFLOAD:
            base = self.offload
        elif v.kind is MKind.TRANSFER:
            base = self.transfer
        else:
            assert tv is not None and tv.op is not None
            base = self.kernel.get(tv.op, 0.0)
        return self.launch + base


def _half(rate16: float, rate32: float) -> dict[str, float]:
    return {"float16": rate16, "bfloat16": rate16, "float32": rate32}


GB = 1e9
# measured on the lent H100 (GPU.md, 2026-11-22): fp16 8192^3 matmul in 1.45 ms = 758 TFLOP/s, fp32
# 21.3 ms = 52 TFLOP/s, pinned H2D 53.3 GB/s, D2H 45.2 GB/s; HBM3 from the spec (3.35 TB/s, ~3 reached);
# peer: NVLink 4 spec, 450 GB/s per direction (the lent machine has one GPU, so it was not measured)
# op_speed: disco_ray.graph.kernels measured there in fp16 (2026-11-22): attention (fused SDPA) 280-400 TFLOP/s
# on 1K-4K query tiles against 4K-16K keys, rmsnorm 218 GB/s and rope 341 GB/s (several passes each)
h100 = Profile(
    "h100",
    _half(758e12, 52e12),
    3.0e12,
    53.3 * GB,
    45.2 * GB,
    450 * GB,
    80 * 2**30,
    op_speed={"attention": 0.45, "rmsnorm": 0.07, "rope": 0.11},
)
# A100 SXM4 40 GB (p4d.24xlarge): 312 TFLOP/s fp16 tensor cores, 19.5 fp32 (no TF32), 1.555 TB/s HBM2,
# PCIe 4 x16 ~25 GB/s per direction (p4d puts two GPUs behind each PCIe switch), NVSwitch 300 GB/s
a100 = Profile(
    "a100", _half(312e12, 19.5e12), 1.555e12, 25 * GB, 25 * GB, 300 * GB, 40 * 2**30, efficiency=0.7
)
# P100 16 GB PCIe: 18.7 TFLOP/s fp16, 9.3 fp32, 732 GB/s HBM2, PCIe 3 x16 ~12 GB/s, GPU peer over PCIe ~10 GB/s
p100 = Profile(
    "p100", _half(18.7e12, 9.3e12), 732 * GB, 12 * GB, 12 * GB, 10 * GB, 16 * 2**30, efficiency=0.7
)
# T4 16 GB (FlexGen's machine, FlexGen section 6): 65 TFLOP/s fp16 tensor cores, 8.1 fp32, 320 GB/s GDDR6,
# PCIe 3.0 x16 measured ~12 GB/s per direction; kernels derated to 0.7 of peak as a100 and p100 are; no
# peer link (one GPU per machine), so peer copies go over PCIe as p100's do
t4 = Profile("t4", _half(65e12, 8.1e12), 320 * GB, 12 * GB, 12 * GB, 10 * GB, 16 * 2**30, efficiency=0.7)
unit = UnitCost()

PROFILES: dict[str, Profile | UnitCost] = {"h100": h100, "a100": a100, "p100": p100, "t4": t4, "unit": unit}


def measure_cpu(launch: float = 30e-6, streams: int = 5) -> Profile:
    """This machine's CPU as a profile for the cpu backend (about a second of micro-benchmarks):
    float32 matmul FLOP/s (a [512, 1024] x [1024, 2816] product, best of 3), memory bytes/s (a
    64 MiB copy, read and written), which is also its load and offload rate (a copy between the
    host store and the arena); `launch`, the runtime's cost per vertex (the local engine's order).
    Speeds of a shared machine drift: a prediction is as good as the moment it was measured."""
    import time

    import torch

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    a, b = torch.randn(512, 1024), torch.randn(1024, 2816)
    flops = 2 * 512 * 1024 * 2816 / best(lambda: a @ b)
    x = torch.randn(16 << 20)
    y = torch.empty_like(x)
    copy = x.numel() * 4 / best(lambda: y.copy_(x))
    rates = {"float32": flops, "float16": flops / 4, "bfloat16": flops / 4}  # no fast half matmul on a CPU
    # the cpu backend launches nothing ahead; its streams' kernels run at once, sharing the cores
    return Profile(
        "cpu",
        rates,
        2 * copy,
        copy,
        copy,
        copy,
        1 << 40,
        launch=launch,
        streams=streams,
        ahead=0,
        overlap=True,
    )


def get(name: str) -> Profile | UnitCost:
    """The profile called `name`; UsageError names the known ones."""
    if name not in PROFILES:
        raise UsageError(f"unknown device profile {name!r} (one of {', '.join(PROFILES)})")
    return PROFILES[name]
