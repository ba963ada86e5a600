"""Packed (quantized) weights in the model graphs: each use reads the weight through `dequantized`."""

from __future__ import annotations

from disco_ray.graph.taskgraph import TaskGraph


def dequantized(g: TaskGraph, w: str, cols: int, dtype: str, id: str, rows: str | None = None) -> str:
    """Weight input `w` (or `rows`, packed rows of it: an embedding lookup's) in the compute
    `dtype`: itself when it is not packed, else a `dequant` vertex `id` on its GPU (one per use,
    so no dequantized copy outlives the op that reads it)."""
    src = g[w].source
    if src is None or src.quant is None:
        return w
    q = src.quant
    return g.kernel("dequant", rows or w, id=id, bits=q.bits, group=q.group, cols=cols, dtype=dtype)
