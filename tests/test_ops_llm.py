"""The transformer ops the real models use, each against plain torch: linear, embedding over
vocabulary shards, grouped-query attention, decode attention at a run-time position, KV writes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disco_ray.graph import ops
from disco_ray.graph.errors import GraphError
from disco_ray.graph.kernels import IMPLS, TEMPS, run_kernel
from disco_ray.graph.kernels_llm import KERNELS
from disco_ray.graph.kernels_llm import TEMPS as LLM_TEMPS
from disco_ray.graph.taskgraph import TaskGraph

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _run(op, out_shape, dtype, ins, **attrs):
    out = torch.empty(out_shape, dtype=dtype)
    run_kernel(op, out, ins, attrs)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_x_times_w_transposed(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 8, generator=g).to(dtype), torch.randn(3, 8, generator=g).to(dtype)
    torch.testing.assert_close(_run("linear", (5, 3), dtype, [x, w]), F.linear(x, w), **TOL[dtype])
    assert ops.OPS["linear"].infer([(5, 8), (3, 8)], [dtype_name(dtype)] * 2, {}) == (
        (5, 3),
        dtype_name(dtype),
    )


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_shards_sum_to_the_whole_lookup(dtype):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(10, 4, generator=g).to(dtype)
    ids = torch.tensor([0, 9, 3, 4, 4, 7])
    parts = [
        _run("embedding", (6, 4), dtype, [ids, table[lo:hi]], start=lo)
        for lo, hi in ((0, 3), (3, 7), (7, 10))
    ]
    torch.testing.assert_close(parts[0] + parts[1] + parts[2], F.embedding(ids, table))
    assert torch.count_nonzero(parts[0][1]) == 0  # id 9 is not in the first shard


def _ref_attention(q, k, v, heads, kv_heads, scale, mask):
    t, s = q.shape[0], k.shape[0]
    qh = q.view(t, heads, -1).transpose(0, 1)
    kh = k.view(s, kv_heads, -1).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    vh = v.view(s, kv_heads, -1).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    p = (qh.float() @ kh.float().transpose(1, 2)) * scale
    p = p.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p @ vh.float()).transpose(0, 1).reshape(t, -1).to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("t, tiles, offset", [(4, 1, 0), (4, 3, 8), (3, 2, 2)])
def test_grouped_query_attention_tile_matches_torch(dtype, heads, kv_heads, t, tiles, offset):
    g = torch.Generator().manual_seed(2)
    d = 8
    q = torch.randn(t, heads * d, generator=g).to(dtype)
    ks = [torch.randn(4, kv_heads * d, generator=g).to(dtype) for _ in range(tiles)]
    vs = [torch.randn(4, kv_heads * d, generator=g).to(dtype) for _ in range(tiles)]
    out = _run(
        "attention", q.shape, dtype, [q, *ks, *vs], heads=heads, kv_heads=kv_heads, scale=0.3, offset=offset
    )
    s = 4 * tiles
    mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + offset
    want = _ref_attention(q, torch.cat(ks), torch.cat(vs), heads, kv_heads, 0.3, mask)
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos", [0, 5, 11])
def test_attention_at_masks_the_cache_past_the_run_time_position(dtype, pos):
    g = torch.Generator().manual_seed(3)
    heads, kvh, d = 4, 2, 8
    q = torch.randn(1, heads * d, generator=g).to(dtype)
    ks = [torch.randn(4, kvh * d, generator=g).to(dtype) for _ in range(3)]
    vs = [torch.randn(4, kvh * d, generator=g).to(dtype) for _ in range(3)]
    p = torch.tensor([pos])
    out = _run("attention_at", q.shape, dtype, [q, p, *ks, *vs], heads=heads, kv_heads=kvh, scale=0.25)
    # the same as the static attention op with the position as its offset
    static = _run(
        "attention", q.shape, dtype, [q, *ks, *vs], heads=heads, kv_heads=kvh, scale=0.25, offset=pos
    )
    torch.testing.assert_close(out, static, **TOL[dtype])
    # keys past pos do not matter: garbage there changes nothing
    junk = [k.clone() for k in ks]
    flat = torch.cat(junk)
    flat[pos + 1 :] = 1e4
    junk = list(flat.split(4))
    again = _run("attention_at", q.shape, dtype, [q, p, *junk, *vs], heads=heads, kv_heads=kvh, scale=0.25)
    torch.testing.assert_close(again, out)


def test_kv_write_replaces_the_rows_at_the_position_and_keeps_the_rest():
    block = torch.arange(24, dtype=torch.float32).view(6, 4)
    new = -torch.ones(2, 4)
    out = _run("kv_write", (6, 4), torch.float32, [block, new, torch.tensor([13])], start=12)
    want = block.clone()
    want[1:3] = -1
    torch.testing.assert_close(out, want)
    inplace = block.clone()  # the output may be the block itself
    run_kernel("kv_write", inplace, [inplace, new, torch.tensor([12])], {"start": 12})
    torch.testing.assert_close(inplace[:2], new)


@pytest.mark.parametrize("kvh", [4, 2])
def test_attention_span_gives_each_group_its_own_keys_and_each_row_its_span(kvh):
    gen = torch.Generator().manual_seed(5)
    heads, d, groups, t = 4, 8, 3, 2
    q = torch.randn(groups * t, heads * d, generator=gen)
    ks = [torch.randn(4, kvh * d, generator=gen) for _ in range(2 * groups)]  # 2 tiles per group
    vs = [torch.randn(4, kvh * d, generator=gen) for _ in range(2 * groups)]
    span = torch.tensor([[0, 7], [2, 5], [3, 3], [6, 2], [1, 6], [0, 0]])  # row 3: empty (padding)
    out = _run(
        "attention_span",
        q.shape,
        torch.float32,
        [q, span, *ks, *vs],
        heads=heads,
        kv_heads=kvh,
        scale=0.3,
        groups=groups,
    )
    for r in range(groups * t):
        g = r // t
        k, v = torch.cat(ks[2 * g : 2 * g + 2]), torch.cat(vs[2 * g : 2 * g + 2])
        lo, hi = span[r].tolist()
        mask = torch.zeros(1, 8, dtype=torch.bool)
        mask[0, lo : hi + 1] = True
        mask[0, hi] = True  # a padding row sees itself
        want = _ref_attention(q[r : r + 1], k, v, heads, kvh, 0.3, mask)
        torch.testing.assert_close(out[r : r + 1], want, **TOL[torch.float32])
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="groups' key tiles differ"):
        ops.OPS["attention_span"].infer(
            [(6, 32), (6, 2), (4, 8 * kvh), (5, 8 * kvh), (4, 8 * kvh), (5, 8 * kvh)] * 1,
            ["float32", "int64", *["float32"] * 4],
            {"heads": 4, "kv_heads": kvh, "scale": 1.0, "groups": 2},
        )
    with pytest.raises(ValueError, match="span must be integers"):
        ops.OPS["attention_span"].infer(
            [(6, 32), (5, 2), (4, 8 * kvh), (4, 8 * kvh)],
            ["float32", "int64", "float32", "float32"],
            {"heads": 4, "kv_heads": kvh, "scale": 1.0, "groups": 1},
        )


def test_kv_write_of_one_row_writes_that_row_only():
    block = torch.zeros(4, 3)
    new = torch.arange(9, dtype=torch.float32).view(3, 3)
    out = _run("kv_write", (4, 3), torch.float32, [block, new, torch.tensor([6])], start=4, row=2)
    want = torch.zeros(4, 3)
    want[2] = new[2]
    torch.testing.assert_close(out, want)
    with pytest.raises(ValueError, match="row 3 is not a row"):
        ops.OPS["kv_write"].infer(
            [(4, 3), (3, 3), (1,)], ["float32", "float32", "int64"], {"row": 3, "start": 0}
        )


def test_bad_shapes_and_attrs_are_refused():
    g = TaskGraph()
    x = g.input("x", (2, 8))
    w = g.input("w", (3, 7))
    with pytest.raises(GraphError, match="linear needs x"):
        g.linear(x, w)
    ids = g.input("ids", (2,), "float32")
    with pytest.raises(GraphError, match="ids must be integers"):
        g.kernel("embedding", ids, x)
    q = g.input("q", (2, 16))
    k = g.input("k", (4, 12))
    with pytest.raises(GraphError, match="kv_heads 3 must divide heads 4"):
        g.kernel("attention", q, k, k, heads=4, kv_heads=3, scale=1.0)
    with pytest.raises(GraphError, match="attribute scale must be a finite number"):
        g.kernel("attention", q, q, q, heads=4, scale="1")
    pos = g.input("pos", (2,), "int64")
    with pytest.raises(GraphError, match="pos must be an integer tensor of shape"):
        g.kernel("attention_at", q, pos, q, q, heads=4, scale=1.0)
    blk = g.input("blk", (2, 16))
    with pytest.raises(GraphError, match="do not fit the block"):
        g.kernel("kv_write", blk, g.input("big", (3, 16)), g.input("p", (1,), "int64"))
    with pytest.raises(GraphError, match="start must be an integer"):
        g.kernel("kv_write", blk, q, g.input("p2", (1,), "int64"), start=1.5)


def test_the_transformer_ops_kernels_are_those_of_kernels_llm():
    llm = {op for op, spec in ops.OPS.items() if spec.infer.__module__.endswith("ops_llm")}
    assert llm == set(KERNELS)
    assert all(IMPLS[op] is KERNELS[op] for op in KERNELS)
    assert all(TEMPS[op] is LLM_TEMPS[op] for op in LLM_TEMPS)
