"""The lower bound of `disco-ray bench`'s `/ bound` column: figures no schedule can beat.

Every GPU must at least run all its kernels and load each of its graph inputs once over its
host-to-GPU link, and those can overlap at best (DISCO §1), so

    bound = max over GPUs g of max(kernel seconds of g, input bytes of g / H2D rate).

The figures never come from a run of our own runtime (whose overheads they would include):
- with a device profile (`--simulate`), its rates (`seconds_from_cost`);
- on the cuda backend, each kernel timed alone on the device, after a warm-up, best of a few
  (`kernel_seconds_alone`), and the best H2D rate of a pinned-copy probe or the run's own loads.
  This assumes a kernel runs no faster than alone when others share the GPU, true of the large
  kernels the bound matters for;
- on the cpu backend there is none: its logical GPUs share the host's cores, so no per-GPU
  figure bounds the run; the column is left out and a note says why.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from disco_ray.graph.dtypes import torch_dtype
from disco_ray.graph.kernels import run_kernel
from disco_ray.graph.memgraph import MemGraph, MKind
from disco_ray.graph.taskgraph import Kind, TaskGraph

NO_CPU_BOUND = (
    "no lower bound on the cpu backend: its logical GPUs share the host's cores, so no per-GPU "
    "figure bounds the run (--simulate PROFILE gives one under a device profile)"
)


def input_bytes(tg: TaskGraph) -> list[int]:
    """Bytes of the graph inputs of each GPU: what its H2D link must carry at least once."""
    out = [0] * tg.gpus
    for v in tg:
        if v.kind is Kind.INPUT:
            out[v.gpu] += v.nbytes
    return out


def h2d_rate_from_records(mg: MemGraph, records: Sequence[Sequence], min_bytes: int = 1 << 20) -> float:
    """The fastest host-to-GPU copy of a run (bytes / its interval; loads of >= min_bytes), 0 if none.

    A bound must use the best rate the link reaches; a run's own copies may beat a separate probe.
    """
    best = 0.0
    for recs in records:
        for vid, _, a, b in recs:
            v = mg.vertex(vid)
            if v.kind in (MKind.INPUT, MKind.RELOAD) and v.out.nbytes >= min_bytes and b > a:
                best = max(best, v.out.nbytes / ((b - a) / 1e9))
    return best


def seconds_from_cost(mg: MemGraph, tg: TaskGraph, cost) -> tuple[list[float], list[float]]:
    """Per GPU, (kernel seconds, input-load seconds) of a plan under a cost model (profile or unit).

    Given the in-memory plan, every graph input is loaded exactly once: the H2D side of the bound.
    """
    kern, load = [0.0] * mg.gpus, [0.0] * mg.gpus
    for v in mg.vertices:
        if v.kind is MKind.KERNEL:
            tv = tg[v.value]
            kern[v.gpu] += float(cost.time(v, tv, [tg[i].shape for i in tv.inputs]))
        elif v.kind is MKind.INPUT:
            load[v.gpu] += float(cost.time(v, None, []))
    return kern, load


def _operand(v, device: str, gen: torch.Generator) -> torch.Tensor:
    dt = torch_dtype(v.dtype)
    if dt.is_floating_point:
        return (torch.rand(v.shape, generator=gen) * 0.2 - 0.1).to(dt).to(device)
    return torch.zeros(v.shape, dtype=dt, device=device)  # ids, positions, steps: row 0, position 0


def kernel_seconds_alone(tg: TaskGraph, device: str = "cpu", repeat: int = 3) -> list[float]:
    """Per GPU, the sum over its kernels of each kernel's time run alone on `device`: operands of
    its shapes made for it (small random floats, zero integers), one warm-up, best of `repeat`;
    timed by CUDA events on a GPU. Only one vertex's operands exist at a time."""
    gen = torch.Generator().manual_seed(0)
    out = [0.0] * tg.gpus
    cuda = device.startswith("cuda")
    for v in tg:
        if v.kind is not Kind.KERNEL or v.op is None:
            continue
        ins = [_operand(tg[i], device, gen) for i in v.inputs]
        dst = torch.empty(v.shape, dtype=torch_dtype(v.dtype), device=device)
        best = float("inf")
        for k in range(repeat + 1):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run_kernel(v.op, dst, ins, v.attrs)
                b.record()
                b.synchronize()
                took = a.elapsed_time(b) / 1e3
            else:
                t = time.perf_counter()
                run_kernel(v.op, dst, ins, v.attrs)
                took = time.perf_counter() - t
            if k:
                best = min(best, took)
        out[v.gpu] += best
    return out


def lower_bound(kernel_s: Sequence[float], h2d_s: Sequence[float], source: str, **extra) -> dict:
    """max over GPUs of max(kernel seconds, H2D seconds of its inputs), with its parts."""
    per = [
        {"gpu": g, "kernel_s": k, "h2d_s": h, "bound_s": max(k, h)}
        for g, (k, h) in enumerate(zip(kernel_s, h2d_s))
    ]
    return {
        "seconds": max((p["bound_s"] for p in per), default=0.0),
        "per_gpu": per,
        "source": source,
        **extra,
    }


def no_bound(note: str = NO_CPU_BOUND) -> dict:
    """The bound entry of a run that has none: the column is left out, the note says why."""
    return {"seconds": None, "per_gpu": [], "source": note}
