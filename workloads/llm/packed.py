"""Packed (quantized) weights in the model graphs: each use reads the weight through `dequantized`."""

from __future__ import annotations

from disco_ray.graph.dtypes import ITEMSIZE
from disco_ray.graph.quant import Layout, Quant
from disco_ray.graph.taskgraph import TaskGraph


def dequantized(
    g: TaskGraph,
    w: str,
    cols: int,
    dtype: str,
    id: str,
    rows: str | None = None,
    span: tuple[int, int] | None = None,
) -> str:
    """Weight input `w` (or `rows`, packed rows of it: an embedding lookup's; or its rows `span`)
    in the compute `dtype`: itself when it is not packed, else a `dequant` vertex `id` on its GPU
    (one per use, so no dequantized copy outlives the op that reads it)."""
    src = g[w].source
    if src is None or src.quant is None:
        return w
    q = src.quant
    at: dict = {} if span is None else {"start": span[0], "stop": span[1]}
    if q.layout is not Layout.ROWS:
        at["layout"] = q.layout.value
    return g.kernel("dequant", rows or w, id=id, bits=q.bits, group=q.group, cols=cols, dtype=dtype, **at)


def fused(g: TaskGraph, w: str) -> Quant | None:
    """The quantization of weight input `w` if it is packed in Layout.CPU, which `qlinear` and
    `qembedding` read directly; else None."""
    src = g[w].source
    q = None if src is None else src.quant
    return q if q is not None and q.layout is Layout.CPU else None


def qlinear(g: TaskGraph, x: str, w: str, cols: int, id: str) -> str:
    """x @ w^T by one `qlinear` vertex `id`, for a packed weight input `w` [n, cols] (`fused`):
    no float copy of w in the arena."""
    q = fused(g, w)
    assert q is not None, w
    return g.kernel("qlinear", x, w, id=id, bits=q.bits, group=q.group, cols=cols, layout=q.layout.value)


def qembedding(g: TaskGraph, ids: str, table: str, cols: int, dtype: str, start: int, id: str) -> str:
    """The rows `ids` - `start` of a packed table input (`fused`) in `dtype`, by one `qembedding`
    vertex `id` (zeros for an id outside the table's rows)."""
    q = fused(g, table)
    assert q is not None, table
    at: dict = dict(bits=q.bits, group=q.group, cols=cols, layout=q.layout.value, start=start, dtype=dtype)
    return g.kernel("qembedding", ids, table, id=id, **at)


def packed_linear(g: TaskGraph, x: str, w: str, cols: int, id: str) -> str:
    """x @ w^T for a weight input `w` [n, cols]; a packed one by `qlinear` where `fused`, else in
    row blocks, each dequantized just before its linear and the logits joined, so that no float
    copy of a large matrix (an LM head) needs the arena at once: each block's float bytes about
    the packed whole's."""
    v = g[w]
    if v.source is None or v.source.quant is None:
        return g.linear(x, w, id=id)
    if fused(g, w):
        return qlinear(g, x, w, cols, id)
    n, blocks = v.shape[0], -(-ITEMSIZE[g[x].dtype] * cols // v.shape[1])
    step = -(-n // blocks)
    parts = [
        g.linear(
            x, dequantized(g, w, cols, g[x].dtype, f"{id}.w{k}", span=(a, min(n, a + step))), id=f"{id}.p{k}"
        )
        for k, a in enumerate(range(0, n, step))
    ]
    return parts[0] if len(parts) == 1 else g.kernel("concat", *parts, id=id, axis=-1)
