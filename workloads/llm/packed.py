"""Packed (quantized) values in the model graphs: each use of a packed weight reads it through
`dequantized`; an int8 KV cache (`Checkpoint.kv_cache`) stores rows as `kv_rows` packs them,
in blocks of `cache_block`, read by a cached attention with `kv_attrs` (dequantized in it)."""

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


def cache_block(kv: Quant | None, block: int, width: int, dtype: str) -> tuple[tuple[int, ...], str]:
    """The shape and dtype of one GPU's KV cache block of `block` rows of `width` (its key/value
    heads): in the compute `dtype`, or packed uint8 rows as `kv` packs them."""
    return ((block, width), dtype) if kv is None else (kv.packed_shape((block, width)), "uint8")


def kv_rows(g: TaskGraph, kv: Quant | None, x: str, id: str) -> str:
    """Key or value rows `x` as the KV cache stores them: themselves, or packed by a `quant`
    vertex `id` (on the device, as the rows are made)."""
    return x if kv is None else g.kernel("quant", x, id=id, bits=kv.bits, group=kv.group)


def kv_attrs(kv: Quant | None) -> dict:
    """What a cached attention (`attention_at`, `attention_span`) adds to read packed blocks."""
    return {} if kv is None else {"kv_bits": kv.bits, "kv_group": kv.group}
