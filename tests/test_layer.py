"""The layer builder (`workloads.llm.layer`) on its own: one decoder layer built from a LayerSpec,
in either vertex order and weight layout, split over 1 or 2 GPUs, with multi-head and
grouped-query attention, computes what a plain torch LLaMA layer on the whole weights computes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disco_ray.graph.reference import evaluate
from disco_ray.graph.taskgraph import TaskGraph
from workloads.llm.layer import ROLES, Layer, LayerSpec, Layout, Order, Split, rope_tables

DIM, HEADS, HD, FFN, SEQ = 32, 4, 8, 48, 6


def spec_of(kv_heads: int | None, order: Order, layout: Layout) -> LayerSpec:
    return LayerSpec(DIM, HEADS, kv_heads, HD, FFN, 1e-5, HD**-0.5, 500.0, order=order, layout=layout)


def whole_weights(spec: LayerSpec, seed: int) -> dict[str, torch.Tensor]:
    """Each weight whole, projections [out, in]."""
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randn(spec.whole(r), generator=gen) / math.sqrt(spec.whole(r)[-1]) for r in ROLES}


def one_layer(spec: LayerSpec, gpus: int, w: dict[str, torch.Tensor]) -> tuple[TaskGraph, dict, str]:
    """A graph of one layer on one tile of SEQ rows (its input on GPU 0), its inputs, its output."""
    g = TaskGraph(gpus)
    split = Split.of(spec, gpus)
    ins: dict[str, torch.Tensor] = {}
    ids: list[dict[str, str]] = []
    for j in range(gpus):
        ids.append({})
        for r in ROLES:
            rows, cols = split.block(spec, r, j)
            block = w[r][slice(*rows) if rows else slice(None)]
            block = block[:, slice(*cols)] if cols else block
            block = block.t() if spec.layout is Layout.IN_OUT and block.dim() == 2 else block
            assert tuple(block.shape) == split.block_shape(spec, r, j)
            ins[f"{r}_g{j}"] = block.contiguous()
            ids[j][r] = g.input(f"{r}_g{j}", tuple(block.shape), "float32", gpu=j)
    lay = Layer(g, spec, split, lambda li, j: ids[j])
    h = lay.broadcast(g.input("h", (SEQ, DIM), "float32", gpu=0), "h")
    cos = [g.input(f"cos_g{j}", (SEQ, HD), "float32", gpu=j) for j in range(gpus)]
    sin = [g.input(f"sin_g{j}", (SEQ, HD), "float32", gpu=j) for j in range(gpus)]
    c, s = rope_tables(spec, torch.arange(SEQ), torch.float32)
    ins |= {f"cos_g{j}": c for j in range(gpus)} | {f"sin_g{j}": s for j in range(gpus)}

    def attend(j: int, q: str, k: str, v: str) -> str:
        return lay.attention(q, [k], [v], f"l0.attn_g{j}", offset=0)

    h1 = lay.attention_block(0, h, cos, sin, "l0", 0, attend)
    (out,) = lay.mlp_block(0, h1, 0, "l0", last=True)
    g.output(out)
    return g, ins, out


def torch_layer(spec: LayerSpec, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """LlamaDecoderLayer's forward, written out: whole weights, [out, in] projections."""

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps) * weight

    def rotate(x, cos, sin):  # x [heads, seq, hd]
        return x * cos + torch.cat((-x[..., HD // 2 :], x[..., : HD // 2]), dim=-1) * sin

    cos, sin = rope_tables(spec, torch.arange(SEQ), torch.float32)
    x = norm(h, w["attn_norm"])
    q, k, v = ((x @ w[r].t()).view(SEQ, -1, HD).transpose(0, 1) for r in "qkv")
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k, v = (t.repeat_interleave(HEADS // spec.kv, dim=0) for t in (k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale)
    h = h + a.transpose(0, 1).reshape(SEQ, DIM) @ w["o"].t()
    x = norm(h, w["mlp_norm"])
    return h + (F.silu(x @ w["gate"].t()) * (x @ w["up"].t())) @ w["down"].t()


@pytest.mark.parametrize("order,layout", [(Order.BY_STEP, Layout.OUT_IN), (Order.BY_GPU, Layout.IN_OUT)])
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_one_layer_computes_a_llama_layer(order, layout, gpus, kv_heads):
    spec = spec_of(kv_heads, order, layout)
    w = whole_weights(spec, seed=3)
    g, ins, out = one_layer(spec, gpus, w)
    ins["h"] = torch.randn(SEQ, DIM, generator=torch.Generator().manual_seed(4))
    got = evaluate(g, ins)[out]
    torch.testing.assert_close(got, torch_layer(spec, w, ins["h"]), atol=1e-5, rtol=1e-5)
    attn = [v for v in g if v.op == "attention"]
    assert len(attn) == gpus and all((v.attrs["kv_heads"] is None) == (kv_heads is None) for v in attn)


def test_the_two_orders_differ_in_order_and_mlp_ids_only():
    w = whole_weights(spec_of(2, Order.BY_STEP, Layout.OUT_IN), seed=0)
    by_step, _, _ = one_layer(spec_of(2, Order.BY_STEP, Layout.OUT_IN), 2, w)
    by_gpu, _, _ = one_layer(spec_of(2, Order.BY_GPU, Layout.OUT_IN), 2, w)
    assert set(by_step.vertices) == set(by_gpu.vertices)
    assert list(by_step.vertices) != list(by_gpu.vertices)
    assert list(by_gpu.vertices).index("l0.o_g0") < list(by_gpu.vertices).index("l0.norm1_g1")
    assert list(by_step.vertices).index("l0.o_g0") > list(by_step.vertices).index("l0.attn_g1")


def test_split_blocks_tile_each_weight_and_copy_a_shared_kv_head():
    spec = spec_of(1, Order.BY_STEP, Layout.OUT_IN)
    split = Split.of(spec, 2, vocab=10)
    assert split.vocab == ((0, 5), (5, 10)) and split.kv_heads == 1 and split.kv_first == (0, 0)
    for r in ("q", "o", "gate", "up", "down"):
        spans = [split.shard(r, j, HD) for j in range(2)]
        axis = 0 if r in ("q", "gate", "up") else 1
        assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == spec.whole(r)[axis]
    assert split.shard("k", 0, HD) == split.shard("k", 1, HD) == (0, HD)
