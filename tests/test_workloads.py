"""Workloads: each builds a valid TaskGraph whose evaluation matches its independent torch reference."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import workloads
from disco_ray.graph import ops
from disco_ray.graph.errors import GraphError, UsageError
from disco_ray.graph.kernels import run_kernel
from disco_ray.graph.reference import evaluate
from disco_ray.graph.taskgraph import Kind, TaskGraph
from workloads import baselines
from workloads.llama import apply_rope, layer_spec
from workloads.llm.layer import rope_tables

CASES = [
    ("matmul_chain", dict(n=3, gpus=2, tokens=8, hidden=16)),
    ("matmul_chain", dict(n=2, gpus=1, tokens=4, hidden=8)),
    ("matmul_chain", dict(n=4, gpus=3, tokens=6, hidden=12, seed=3)),
    ("tp_matmul", dict(gpus=2, m=16, k=32, n=8)),
    ("tp_matmul", dict(gpus=4, m=8, k=16, n=8, seed=1)),
    ("tp_matmul", dict(gpus=1, m=8, k=8, n=8)),
    ("llama_prefill", dict()),
    ("llama_prefill", dict(gpus=1, layers=1)),
    ("llama_prefill", dict(gpus=4, heads=8, seq=48, tile=16, layers=2, seed=5)),
    ("llama_prefill", dict(gpus=2, seq=32, tile=32)),
    ("llama_prefill", dict(gpus=2, seq=64, tile=8, dim=32, heads=2, ffn=64, layers=1)),
    ("llama_prefill", dict(gpus=2, seq=64, tile=16, layers=2, lookahead=1)),
    ("llama_prefill", dict(gpus=4, heads=4, seq=48, tile=8, layers=2, lookahead=3)),
]


@pytest.mark.parametrize(("name", "kw"), CASES)
def test_workload_matches_its_reference(name, kw):
    w = workloads.build(name, **kw)
    w.taskgraph.validate()
    assert TaskGraph.from_dict(w.taskgraph.to_dict()).vertices == w.taskgraph.vertices
    got = evaluate(w.taskgraph, w.inputs)
    want = w.reference(w.inputs)
    assert set(got) == set(want) == set(w.taskgraph.outputs)
    for k in want:
        assert got[k].shape == want[k].shape
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=f"{name} {kw} output {k}")


@pytest.mark.parametrize(("name", "kw"), CASES)
def test_levels_and_weights_name_graph_vertices(name, kw):
    w = workloads.build(name, materialize=False, **kw)
    tg = w.taskgraph
    seen = [x for ids in w.levels for x in ids]
    assert len(seen) == len(set(seen)), "a vertex is in two levels"
    assert set(seen) == set(tg.vertices), "levels must cover the graph"
    assert all(tg[x].kind is Kind.INPUT for x in w.weights)
    assert w.inputs == {}
    # a vertex's inputs lie in its own level or an earlier one
    lv = w.level_of()
    for v in tg:
        assert all(lv[i] <= lv[v.id] for i in v.inputs), v.id


def test_matmul_chain_structure():
    w = workloads.build("matmul_chain", n=3, gpus=2, tokens=4, hidden=8)
    tg = w.taskgraph
    assert len(w.levels) == 3
    assert w.weights == [f"y{i}_g{j}" for i in range(3) for j in range(2)]
    assert all(
        tg[y].shape == (8, 4) and tg[y].gpu == j
        for i in range(3)
        for j, y in enumerate(w.weights[2 * i :][:2])
    )
    stats = tg.statistics()["by_kind"]
    assert stats == {"input": 2 + 6, "kernel": 3 * (2 + 2), "transfer": 3 * 2}


def test_llama_structure_and_presets():
    w = workloads.build("llama_prefill", preset="7b", layers=2, seq=2048, tile=1024, materialize=False)
    tg = w.taskgraph
    assert w.params["dim"] == 4096 and w.params["gpus"] == 4 and w.params["dtype"] == "float16"
    assert len(w.levels) == 2 and len(w.meta["layer_weights"]) == 2
    # 9 weights per GPU per layer; a layer's weight bytes are LLaMA-7B's (4*d^2 + 3*d*ffn + 2*d) * 2 bytes
    assert len(w.weights) == 2 * 9 * 4
    per_layer = sum(tg[x].nbytes for x in w.weights) // 2
    assert per_layer == (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4 * 4096) * 2
    attn = [v for v in tg if v.kind is Kind.KERNEL and v.op == "attention"]
    assert {v.attrs["offset"] for v in attn} == {0, 1024}
    assert all(v.attrs["heads"] == 8 for v in attn)
    w65 = workloads.build("llama_prefill", preset="65b", layers=1, seq=512, materialize=False)
    assert w65.params["dim"] == 8192 and w65.params["heads"] == 64 and w65.params["ffn"] == 22016


def test_llama_lookahead_reorders_only():
    a = workloads.build("llama_prefill", materialize=False)
    b = workloads.build("llama_prefill", lookahead=2, materialize=False)
    assert a.taskgraph.vertices == b.taskgraph.vertices and a.taskgraph.outputs == b.taskgraph.outputs
    assert a.order() != b.order()
    pos = {v: n for n, v in enumerate(b.order())}
    assert pos["l0.t2.attn_g0"] < pos["l0.t0.norm2_g0"] < pos["l0.t3.attn_g0"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(lookahead=-1),
        dict(heads=3),
        dict(gpus=3),
        dict(seq=60),
        dict(layers=0),
        dict(preset="13b"),
        dict(dim=36, heads=4),
    ],
)
def test_llama_refuses_bad_parameters(kw):
    with pytest.raises(UsageError):
        workloads.build("llama_prefill", materialize=False, **kw)


def test_registry():
    assert {"matmul_chain", "tp_matmul", "llama_prefill", "random_dag"} <= set(workloads.names())
    p = workloads.params("matmul_chain")
    assert p["n"] == (int, 4) and p["dtype"] == (str, "float32") and p["materialize"][0] is bool
    assert workloads.params("llama_prefill")["layers"][0] is int
    w = workloads.build_from_strings("matmul_chain", {"n": "2", "gpus": "1", "materialize": "false"})
    assert w.params["n"] == 2 and w.inputs == {}
    w = workloads.build_from_strings("llama_prefill", {"layers": "1", "tile": "none"})
    assert w.params["tile"] == 16
    with pytest.raises(UsageError, match="unknown workload"):
        workloads.build("nope")
    with pytest.raises(UsageError, match="no parameter"):
        workloads.build("matmul_chain", layers=3)
    with pytest.raises(UsageError, match="not a valid int"):
        workloads.build_from_strings("matmul_chain", {"n": "x"})


def test_random_dag_is_registered_lazily():
    if importlib.util.find_spec("workloads.random_dag") is None:
        with pytest.raises(UsageError, match="not available"):
            workloads.build("random_dag")
        return
    w = workloads.build("random_dag", n=30, gpus=2, seed=1)
    w.taskgraph.validate()
    got, want = evaluate(w.taskgraph, w.inputs), w.reference(w.inputs)
    assert set(got) == set(want)
    lv = w.level_of()
    assert all(lv[i] < lv[v.id] for v in w.taskgraph for i in v.inputs)


# ---- the ops the workloads added -------------------------------------------------------------
def _attention_ref(q, k, v, heads, scale, offset):
    t, hd = q.shape[0], q.shape[1] // heads
    s = k.shape[0]
    qh, kh, vh = (x.view(x.shape[0], heads, hd).transpose(0, 1) for x in (q, k, v))
    mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + offset
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(t, heads * hd)


@pytest.mark.parametrize(("t", "tiles", "offset"), [(4, 1, 0), (4, 3, 8), (3, 2, 5), (5, 2, 0)])
def test_attention_op_matches_sdpa(t, tiles, offset):
    gen = torch.Generator().manual_seed(t * 100 + tiles)
    q = torch.randn(t, 12, generator=gen)
    ks = [torch.randn(4, 12, generator=gen) for _ in range(tiles)]
    vs = [torch.randn(4, 12, generator=gen) for _ in range(tiles)]
    out = torch.empty(t, 12)
    run_kernel("attention", out, [q, *ks, *vs], dict(heads=3, scale=0.3, offset=offset))
    torch.testing.assert_close(out, _attention_ref(q, torch.cat(ks), torch.cat(vs), 3, 0.3, offset))


def test_attention_flops_count_only_unmasked_pairs():
    cases = [(4, 8, 4), (4, 4, 0), (5, 3, 0), (3, 10, 2), (6, 6, 9), (4, 4, -1), (4, 4, -3), (4, 4, -9)]
    for t, keys, off in cases:  # negative offsets: a key tile after the query tile (the backward's pairs)
        brute = sum(min(keys, max(0, off + r + 1)) for r in range(t))
        assert ops.attention_pairs(t, keys, off, True) == brute
        assert ops.attention_pairs(t, keys, off, False) == t * keys
    spec = ops.OPS["attention"]
    attrs = spec.full_attrs(dict(heads=2, scale=1.0))
    assert spec.flops([(4, 8), (4, 8), (4, 8)], (4, 8), attrs) == 10 * 2 * (4 * 4 + 5)


def test_rope_op_matches_reference_rotation():
    cos, sin = rope_tables(layer_spec(dim=8, heads=2, ffn=8), torch.arange(6), torch.float32)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    out = torch.empty(6, 8)
    run_kernel("rope", out, [x, cos, sin], {})
    want = apply_rope(x.view(6, 2, 4).transpose(0, 1), cos, sin).transpose(0, 1).reshape(6, 8)
    torch.testing.assert_close(out, want)
    # a rotation keeps each pair's norm
    xr = x.view(6, 2, 2, 2)
    orr = out.view(6, 2, 2, 2)
    torch.testing.assert_close((xr**2).sum(2), (orr**2).sum(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rmsnorm_op_matches_the_formula(dtype, weighted):
    """x / sqrt(mean(x^2) + eps) in float32, cast back, times the weight (LLaMA's RMSNorm)."""
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(5, 32, generator=gen)).to(dtype)
    w = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
    out = torch.empty(5, 32, dtype=dtype)
    run_kernel("rmsnorm", out, [x, w] if weighted else [x], {"eps": 1e-5})
    xf = x.float()
    want = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    if weighted:
        want = want * w.float()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_concat_op_and_shape_errors():
    g = TaskGraph(1)
    a = g.input("a", (2, 3))
    b = g.input("b", (2, 5))
    c = g.kernel("concat", a, b, axis=1)
    assert g[c].shape == (2, 8)
    assert g[g.kernel("concat", a, a, axis=0)].shape == (4, 3)
    with pytest.raises(GraphError, match="differ off axis"):
        g.kernel("concat", a, b, axis=0)
    q = g.input("q", (4, 8))
    k = g.input("k", (4, 6))
    with pytest.raises(GraphError, match="does not match"):
        g.kernel("attention", q, k, k, heads=2, scale=1.0)
    with pytest.raises(GraphError, match="pairs"):
        g.kernel("attention", q, q, q, q, heads=2, scale=1.0)
    cs = g.input("cs", (4, 3))
    with pytest.raises(GraphError, match="rope"):
        g.kernel("rope", q, cs, cs)
    assert math.isclose(ops.OPS["rope"].flops([(4, 8)], (4, 8), {}), 96)


# ---- torch baselines -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "kw"),
    [("matmul_chain", dict(n=4, gpus=2, tokens=8, hidden=16)), ("llama_prefill", dict(layers=2, gpus=2))],
)
@pytest.mark.parametrize("which", sorted(baselines.BASELINES))
def test_baselines_match_reference(name, kw, which):
    w = workloads.build(name, **kw)
    r = baselines.BASELINES[which](w, device="cpu")
    want = w.reference(w.inputs)
    assert r.device == "cpu" and r.seconds > 0 and r.name == which
    assert set(r.outputs) == set(want)
    for k in want:
        torch.testing.assert_close(r.outputs[k], want[k], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("which", sorted(baselines.BASELINES))
def test_baselines_on_cuda(which):
    w = workloads.build("llama_prefill", layers=3, gpus=2, seq=128, tile=32, dim=128, heads=4, ffn=256)
    r = baselines.BASELINES[which](w, device="cuda")
    want = w.reference(w.inputs)
    for k in want:
        torch.testing.assert_close(r.outputs[k], want[k], rtol=1e-3, atol=1e-3)


def test_baselines_refuse_other_workloads():
    with pytest.raises(UsageError):
        baselines.torch_naive(workloads.build("tp_matmul"))
    with pytest.raises(UsageError, match="without inputs"):
        baselines.torch_naive(workloads.build("matmul_chain", materialize=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_workload_ops_on_cuda_fp16():
    w = workloads.build("llama_prefill", gpus=2, seq=64, tile=16, dim=128, heads=4, ffn=256, layers=2)
    tg16 = workloads.build(
        "llama_prefill", gpus=2, seq=64, tile=16, dim=128, heads=4, ffn=256, layers=2, dtype="float16"
    )
    ins16 = {k: v.half() for k, v in w.inputs.items()}
    got = evaluate(tg16.taskgraph, ins16, device="cuda")
    want = w.reference(w.inputs)
    for k in want:
        torch.testing.assert_close(got[k].float().cpu(), want[k], rtol=2e-2, atol=2e-2)
