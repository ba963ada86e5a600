"""The training ops against torch: each gradient op against torch.autograd of the forward it
differentiates (computed in float32 on the same rounded inputs), per dtype; the tiled attention
backward against autograd of whole causal attention; cross-entropy over vocabulary shards against
F.cross_entropy; adamw and sgd against torch.optim; the refusals of bad shapes and attributes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from disco_ray.graph import ops
from disco_ray.graph.dtypes import from_torch
from disco_ray.graph.errors import GraphError
from disco_ray.graph.kernels import IMPLS, run_kernel
from disco_ray.graph.kernels_train import KERNELS
from disco_ray.graph.taskgraph import TaskGraph

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: elementwise; low precision: the relative norm of the error (rounding the stored
# statistics and the result to the dtype uses up to ~0.7 of these bounds)
REL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _run(op: str, ins: list[torch.Tensor], out: torch.Tensor | None = None, **attrs) -> torch.Tensor:
    """Runs `op` into a NaN-filled tensor of the inferred shape and dtype (so every element must be
    written), or into `out`."""
    spec = ops.OPS[op]
    full = spec.full_attrs(attrs)
    shape, dtype = spec.infer([tuple(x.shape) for x in ins], [from_torch(x.dtype) for x in ins], full)
    if out is None:
        dt = getattr(torch, dtype)
        out = torch.full(shape, float("nan") if dt.is_floating_point else -7, dtype=dt)
    assert tuple(out.shape) == tuple(shape)
    run_kernel(op, out, ins, attrs)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert got.dtype == dtype, what
    got = got.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    assert torch.isfinite(got).all(), what
    err = ((got - want).norm() / want.norm().clamp_min(1e-6)).item()
    assert err < REL[dtype], f"{what}: relative error {err:.2e} >= {REL[dtype]}"


def _randn(*shape, g, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _grad(fn, *xs: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """Autograd, in float32, of fn(*xs) with output gradient dy, w.r.t. each x."""
    leaves = [x.detach().float().requires_grad_() for x in xs]
    fn(*leaves).backward(dy.float())
    return [x.grad for x in leaves]


# ---- elementwise backward ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_grad_is_autograd_of_rmsnorm_with_a_frozen_weight(dtype):
    g = torch.Generator().manual_seed(10)
    x, w, dy = (
        _randn(2, 5, 16, g=g, dtype=dtype),
        _randn(16, g=g, dtype=dtype),
        _randn(2, 5, 16, g=g, dtype=dtype),
    )
    (want,) = _grad(lambda x: F.rms_norm(x, (16,), w.float(), 1e-5), x, dy=dy)
    _close(_run("rmsnorm_grad", [x, w, dy], eps=1e-5), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_grad_is_autograd_of_silu(dtype):
    g = torch.Generator().manual_seed(11)
    a, dh = _randn(6, 24, g=g, dtype=dtype) * 3, _randn(6, 24, g=g, dtype=dtype)
    (want,) = _grad(F.silu, a, dy=dh)
    _close(_run("silu_grad", [a, dh]), want, dtype)


def _rope_ref(x, cos, sin):
    d = cos.shape[-1]
    xv = x.unflatten(-1, (-1, d))
    rot = torch.cat((-xv[..., d // 2 :], xv[..., : d // 2]), dim=-1)
    return (xv * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inverse_rope_is_the_backward_of_rope(dtype):
    g = torch.Generator().manual_seed(12)
    s, d = 5, 8
    # arbitrary cos/sin tables: the transpose is the gradient whatever they hold
    x, dy = _randn(s, 3 * d, g=g, dtype=dtype), _randn(s, 3 * d, g=g, dtype=dtype)
    cos, sin = _randn(s, d, g=g, dtype=dtype), _randn(s, d, g=g, dtype=dtype)
    (want,) = _grad(lambda x: _rope_ref(x, cos.float(), sin.float()), x, dy=dy)
    _close(_run("rope", [dy, cos, sin], inverse=True), want, dtype)
    _close(_run("rope", [x, cos, sin]), _rope_ref(x.float(), cos.float(), sin.float()), dtype, "forward")


def test_inverse_rope_undoes_rope_with_llama_tables():
    s, d = 6, 8
    theta = torch.arange(s)[:, None] * 10000 ** (-torch.arange(0, d, 2) / d)[None, :]
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
    x = torch.randn(2, s, 2 * d, generator=torch.Generator().manual_seed(13))
    y = _run("rope", [x, cos, sin])
    torch.testing.assert_close(_run("rope", [y, cos, sin], inverse=True), x)
    inplace = y.clone()  # the runtime may hand the input's own range as the output
    run_kernel("rope", inplace, [inplace, cos, sin], {"inverse": True})
    torch.testing.assert_close(inplace, x)
    assert ops.OPS["rope"].flops([(4, 8)], (4, 8), {"inverse": True}) == ops.OPS["rope"].flops(
        [(4, 8)], (4, 8), {}
    )


# ---- attention: the tiled backward against autograd of the whole ------------------------------
def _attention_ref(q, k, v, heads, kv_heads, scale, causal, offset=0):
    t, s = q.shape[0], k.shape[0]
    qh = q.view(t, heads, -1).transpose(0, 1)
    kh = k.view(s, kv_heads, -1).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    vh = v.view(s, kv_heads, -1).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    scores = (qh @ kh.transpose(1, 2)) * scale
    if causal:
        mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + offset
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(t, -1), scores


def _starts(sizes):
    return [sum(sizes[:i]) for i in range(len(sizes))]


LAYOUTS = [  # (query tile sizes, key tile sizes, causal)
    ((4, 4, 4), (4, 4, 4), True),
    ((5, 3, 4), (6, 6), True),
    ((12,), (5, 7), True),
    ((3, 9), (12,), True),
    ((6, 6), (4, 8), False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("q_tiles, k_tiles, causal", LAYOUTS)
def test_tiled_attention_backward_equals_autograd_of_whole_attention(
    dtype, heads, kv_heads, q_tiles, k_tiles, causal
):
    g = torch.Generator().manual_seed(20)
    n, d, scale = sum(q_tiles), 8, 0.35
    assert sum(k_tiles) == n
    q, do = _randn(n, heads * d, g=g, dtype=dtype), _randn(n, heads * d, g=g, dtype=dtype)
    k, v = _randn(n, kv_heads * d, g=g, dtype=dtype), _randn(n, kv_heads * d, g=g, dtype=dtype)
    want_q, want_k, want_v = _grad(
        lambda q, k, v: _attention_ref(q, k, v, heads, kv_heads, scale, causal)[0], q, k, v, dy=do
    )
    ks, vs = list(k.split(k_tiles)), list(v.split(k_tiles))
    attrs = dict(heads=heads, kv_heads=kv_heads, scale=scale, causal=causal)
    dqs, dkv = [], torch.zeros(n, 2 * kv_heads * d)
    for q0, qt in zip(_starts(q_tiles), q_tiles):
        qi, doi = q[q0 : q0 + qt], do[q0 : q0 + qt]
        # the query tile's forward and stats see the key tiles it may attend to, as the layers build it
        seen = [j for j, k0 in enumerate(_starts(k_tiles)) if not causal or k0 < q0 + qt]
        kv = [ks[j] for j in seen] + [vs[j] for j in seen]
        oi = _run("attention", [qi, *kv], offset=q0, **attrs)
        stats = _run("attention_stats", [qi, *kv, oi, doi], offset=q0, **attrs)
        dqs.append(_run("attention_grad_q", [qi, stats, doi, *kv], offset=q0, **attrs))
        for j, k0 in enumerate(_starts(k_tiles)):  # every pair: one the mask hides adds exact zeros
            part = _run(
                "attention_grad_kv", [qi, stats, doi, ks[j], vs[j]], q_offset=q0, k_offset=k0, **attrs
            )
            assert torch.isfinite(part).all()
            if causal and k0 >= q0 + qt:
                assert not part.any(), "a key tile after the query tile got a gradient"
            dkv[k0 : k0 + k_tiles[j]] += part.float()
    _close(torch.cat(dqs), want_q, dtype, "dq")
    _close(dkv[:, : kv_heads * d].to(dtype), want_k, dtype, "dk")
    _close(dkv[:, kv_heads * d :].to(dtype), want_v, dtype, "dv")


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_stats_are_the_log_sum_exp_and_rowsum_of_do_times_o(kv_heads):
    g = torch.Generator().manual_seed(21)
    heads, d, t, offset = 4, 8, 3, 5
    q, do = _randn(t, heads * d, g=g), _randn(t, heads * d, g=g)
    ks = [_randn(4, kv_heads * d, g=g) for _ in range(2)]
    vs = [_randn(4, kv_heads * d, g=g) for _ in range(2)]
    o, scores = _attention_ref(q, torch.cat(ks), torch.cat(vs), heads, kv_heads, 0.5, True, offset)
    stats = _run(
        "attention_stats", [q, *ks, *vs, o, do], heads=heads, kv_heads=kv_heads, scale=0.5, offset=offset
    )
    torch.testing.assert_close(stats[:, :heads], scores.logsumexp(-1).T)
    torch.testing.assert_close(stats[:, heads:], (do * o).view(t, heads, d).sum(-1))


# ---- linear, embedding, cross-entropy ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_grad_w_is_autograd_of_linear_w_r_t_the_weight(dtype):
    g = torch.Generator().manual_seed(30)
    x, w, dy = (
        _randn(2, 5, 12, g=g, dtype=dtype),
        _randn(7, 12, g=g, dtype=dtype),
        _randn(2, 5, 7, g=g, dtype=dtype),
    )
    (want,) = _grad(lambda w: F.linear(x.float(), w), w, dy=dy)
    _close(_run("linear_grad_w", [dy, x], scale=0.5), want * 0.5, dtype)
    _close(_run("linear_grad_w", [dy.view(10, 7), x.view(10, 12)]), want, dtype, "rows flattened")


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_grad_shards_scatter_add_into_the_table_gradient(dtype):
    g = torch.Generator().manual_seed(31)
    table, ids = _randn(10, 6, g=g, dtype=dtype), torch.tensor([0, 9, 3, 4, 4, 7, 3, 4])
    dy = _randn(8, 6, g=g, dtype=dtype)
    (want,) = _grad(lambda t: F.embedding(ids, t), table, dy=dy)
    shards = [(0, 3), (3, 7), (7, 10)]
    parts = [_run("embedding_grad", [ids.int(), dy], start=lo, rows=hi - lo) for lo, hi in shards]
    _close(torch.cat(parts), want, dtype)


def _shards(v: int, n: int) -> list[tuple[int, int]]:
    cuts = [v * i // n for i in range(n + 1)]
    return list(itertools.pairwise(cuts))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_shards", [1, 2, 3])
def test_cross_entropy_over_vocabulary_shards_equals_torch(dtype, n_shards):
    g = torch.Generator().manual_seed(32)
    t, v = 9, 13
    logits = (_randn(t, v, g=g) * 3).to(dtype)
    labels = torch.tensor([0, 12, -100, 5, 6, 7, -100, 4, 9])  # ids of every shard, ignored rows
    valid = int((labels != -100).sum())
    shards = _shards(v, n_shards)
    parts = [_run("cross_entropy_parts", [logits[:, lo:hi], labels], start=lo) for lo, hi in shards]
    combined = _run("cross_entropy_combine", [*parts, labels])
    x = logits.float().requires_grad_()
    want = F.cross_entropy(x, labels, ignore_index=-100)  # the mean over the rows with a label
    want.backward()
    got = combined[:, 0].float().sum() / valid
    tol = 1e-5 if dtype == torch.float32 else REL[dtype]
    torch.testing.assert_close(got, want.detach(), atol=tol, rtol=tol)
    _close(combined[:, 1], logits.float().logsumexp(-1), dtype, "overall log-sum-exp")
    assert not combined[labels == -100, 0].any()
    grads = [
        _run("cross_entropy_grad", [logits[:, lo:hi], labels, combined], start=lo, scale=1 / valid)
        for lo, hi in shards
    ]
    _close(torch.cat(grads, 1), x.grad, dtype, "dlogits")


# ---- optimizer steps ---------------------------------------------------------------------------
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("step_dtype", [torch.int64, torch.float32])
def test_adamw_steps_equal_torch_optim_adamw(weight_decay, step_dtype):
    g = torch.Generator().manual_seed(40)
    p = torch.randn(4, 3, generator=g)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW(
        [ref], lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, foreach=False
    )
    state = torch.cat([p, torch.zeros_like(p), torch.zeros_like(p)])
    attrs = dict(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=weight_decay)
    for step in range(1, 7):
        grad = torch.randn(4, 3, generator=g)
        ref.grad = grad.clone()
        opt.step()
        t = torch.tensor([step], dtype=step_dtype)
        if step % 2:  # in place (the output is the state's range) and into a separate output
            run_kernel("adamw", state, [state, grad, t], attrs)
        else:
            state = _run("adamw", [state, grad, t], **attrs)
        s = opt.state[ref]
        want = torch.cat([ref.detach(), s["exp_avg"], s["exp_avg_sq"]])
        torch.testing.assert_close(state, want, atol=0, rtol=0)  # op for op: bit for bit


def test_adamw_in_bfloat16_follows_the_float32_step():
    g = torch.Generator().manual_seed(41)
    p, grad = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    state = torch.cat([p, grad * 0.1, grad.square() * 0.01])
    attrs = dict(lr=0.01, weight_decay=0.1)
    want = _run("adamw", [state, grad, torch.tensor([3])], **attrs)
    got = _run("adamw", [state.bfloat16(), grad.bfloat16(), torch.tensor([3])], **attrs)
    _close(got, want, torch.bfloat16)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgd_steps_equal_torch_optim_sgd(weight_decay):
    g = torch.Generator().manual_seed(42)
    p = torch.randn(5, 2, generator=g)
    ref = p.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.1, weight_decay=weight_decay, foreach=False)
    for _ in range(3):
        grad = torch.randn(5, 2, generator=g)
        ref.grad = grad.clone()
        opt.step()
        run_kernel("sgd", p, [p, grad], {"lr": 0.1, "weight_decay": weight_decay})  # in place
    torch.testing.assert_close(p, ref.detach(), atol=0, rtol=0)


# ---- slice -------------------------------------------------------------------------------------
def test_slice_copies_a_range_along_an_axis():
    x = torch.arange(60).view(3, 4, 5)
    torch.testing.assert_close(_run("slice", [x], axis=1, start=1, stop=3), x[:, 1:3])
    torch.testing.assert_close(_run("slice", [x.float()], axis=-1, start=0, stop=5), x.float())
    y = _run("slice", [x], axis=0, start=2, stop=3)
    x[2] = 0  # a copy, not a view
    assert y.sum() == sum(range(40, 60))


# ---- kernels read no data on the host ----------------------------------------------------------
def test_every_training_kernel_runs_on_meta_tensors():
    # meta tensors have no data: a kernel that reads a value on the host (.item(), a data-dependent
    # shape such as nonzero or boolean indexing) fails here, as it would sync a GPU
    ins = {
        "rmsnorm_grad": ([(3, 8), (8,), (3, 8)], {}),
        "silu_grad": ([(3, 8), (3, 8)], {}),
        "attention_stats": (
            [(3, 16), (4, 8), (4, 8), (3, 16), (3, 16)],
            dict(heads=2, kv_heads=1, scale=0.5),
        ),
        "attention_grad_q": (
            [(3, 16), (3, 4), (3, 16), (4, 8), (4, 8)],
            dict(heads=2, kv_heads=1, scale=0.5),
        ),
        "attention_grad_kv": (
            [(3, 16), (3, 4), (3, 16), (4, 8), (4, 8)],
            dict(heads=2, kv_heads=1, scale=0.5),
        ),
        "linear_grad_w": ([(3, 8), (3, 5)], {}),
        "cross_entropy_parts": ([(3, 8), ("i", 3)], dict(start=4)),
        "cross_entropy_combine": ([(3, 2), (3, 2), ("i", 3)], {}),
        "cross_entropy_grad": ([(3, 8), ("i", 3), (3, 2)], dict(start=4)),
        "embedding_grad": ([("i", 3), (3, 8)], dict(rows=5)),
        "adamw": ([(6, 4), (2, 4), ("i", 1), ("i", 1)], dict(lr=0.1, weight_decay=0.1)),
        "sgd": ([(2, 4), (2, 4), ("i", 1)], dict(lr=0.1, weight_decay=0.1)),
        "slice": ([(6, 4)], dict(axis=0, start=1, stop=3)),
    }
    assert set(ins) == set(KERNELS) and all(IMPLS[k] is KERNELS[k] for k in KERNELS)
    for op, (shapes, attrs) in ins.items():
        ts = [
            torch.empty(s[1:], dtype=torch.int64, device="meta")
            if s[0] == "i"
            else torch.empty(s, device="meta")
            for s in shapes
        ]
        spec = ops.OPS[op]
        shape, _ = spec.infer(
            [tuple(t.shape) for t in ts], [from_torch(t.dtype) for t in ts], spec.full_attrs(attrs)
        )
        run_kernel(op, torch.empty(shape, device="meta"), ts, attrs)


# ---- refusals ----------------------------------------------------------------------------------
def test_bad_shapes_and_attrs_are_refused_with_the_reason():
    g = TaskGraph()
    x, w = g.input("x", (4, 8)), g.input("w", (8,))
    q, k = g.input("q", (4, 16)), g.input("k", (4, 8))
    st, lab = g.input("st", (4, 8)), g.input("lab", (4,), "int64")
    bad = [
        (lambda: g.kernel("rmsnorm_grad", x, g.input("w7", (7,)), x), "rmsnorm_grad needs x"),
        (lambda: g.kernel("rmsnorm_grad", x, w, x, eps=-1.0), "attribute eps must be a finite number >= 0"),
        (lambda: g.kernel("silu_grad", x, q), "silu_grad operands have different shapes"),
        (lambda: g.kernel("rope", x, k, k, inverse="yes"), "rope: attribute inverse must be true or false"),
        (
            lambda: g.kernel("attention_stats", q, k, k, x, q, heads=4, kv_heads=2, scale=1.0),
            r"o \[4, 8\] and do",
        ),
        (
            lambda: g.kernel("attention_stats", q, k, k, q, q, heads=4, kv_heads=2, scale=1.0, causal=1),
            "causal must be",
        ),
        (
            lambda: g.kernel(
                "attention_grad_q", q, g.input("st4", (4, 4)), q, k, k, heads=4, kv_heads=2, scale=1.0
            ),
            r"stats must be \[4, 8\]",
        ),
        (
            lambda: g.kernel("attention_grad_q", q, st, q, k, k, k, heads=4, kv_heads=2, scale=1.0),
            "takes q, stats, do and pairs",
        ),
        (lambda: g.kernel("attention_grad_kv", q, st, q, k, k, heads=4, kv_heads=3, scale=1.0), "kv_heads 3"),
        (lambda: g.kernel("attention_grad_kv", q, st, q, k, q, heads=4, kv_heads=2, scale=1.0), "tile 0"),
        (
            lambda: g.kernel(
                "attention_grad_kv", q, st, q, k, k, heads=4, kv_heads=2, scale=1.0, q_offset=0.5
            ),
            "q_offset",
        ),
        (lambda: g.kernel("linear_grad_w", x, g.input("x3", (3, 8))), "with the same rows"),
        (lambda: g.kernel("cross_entropy_parts", x, g.input("fl", (4,))), "labels must be an integer vector"),
        (lambda: g.kernel("cross_entropy_parts", x, lab, start=-1), "start must be an integer >= 0"),
        (lambda: g.kernel("cross_entropy_combine", x, lab), r"parts must all be \[t, 2\]"),
        (lambda: g.kernel("cross_entropy_grad", x, lab, x), r"combined must be \[4, 2\]"),
        (lambda: g.kernel("embedding_grad", lab, x), "needs attribute 'rows'"),
        (lambda: g.kernel("embedding_grad", lab, x, rows=0), "rows must be an integer >= 1"),
        (
            lambda: g.kernel("embedding_grad", g.input("i3", (3,), "int64"), x, rows=2),
            r"ids must be an integer vector \[4\]",
        ),
        (lambda: g.kernel("adamw", x, x, g.input("s", (1,), "int64")), "needs attribute 'lr'"),
        (lambda: g.kernel("adamw", g.input("s12", (12, 8)), x, lab, lr=0.1), "step must be"),
        (lambda: g.kernel("adamw", x, x, g.input("s1", (1,), "int64"), lr=0.1), r"state must be \[3\*r"),
        (
            lambda: g.kernel("adamw", g.input("s2", (12, 8)), x, g.input("s3", (1,)), lr=0.1, beta1=1.0),
            "beta1 < 1.0",
        ),
        (lambda: g.kernel("sgd", x, x, lr=-0.1), "sgd: attribute lr must satisfy"),
        (lambda: g.kernel("sgd", x, x, lr="0.1"), "sgd: attribute lr must be a finite number"),
        (lambda: g.kernel("linear_grad_w", x, x, scale=float("nan")), "scale must be a finite number"),
        (lambda: g.kernel("slice", x, axis=2, start=0, stop=1), "axis 2 out of range for rank 2"),
        (lambda: g.kernel("slice", x, axis=1, start=3, stop=9), r"\[3, 9\) is not a non-empty range of 0..8"),
        (lambda: g.kernel("slice", x, axis=0, start=2, stop=2), "not a non-empty range"),
    ]
    for make, match in bad:
        with pytest.raises(GraphError, match=match):
            make()
            pytest.fail(f"not refused: the case expecting {match!r}")


def test_every_training_op_has_a_doc_and_flops():
    for name in KERNELS:
        spec = ops.OPS[name]
        assert spec.doc and spec.flops is not None, name
    # a pair of tiles the causal mask hides entirely costs nothing
    attrs = ops.OPS["attention_grad_kv"].full_attrs(dict(heads=2, scale=1.0, q_offset=0, k_offset=4))
    assert (
        ops.OPS["attention_grad_kv"].flops([(4, 16), (4, 4), (4, 16), (4, 16), (4, 16)], (4, 32), attrs) == 0
    )
