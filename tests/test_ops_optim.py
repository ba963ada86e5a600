"""The optimizer ops with the learning rate as an input, and gradient-norm clipping (`ops_optim`):
AdamW and SGD under a schedule equal torch.optim + LambdaLR bit for bit; sum_squares, clip_coef
and scale_grad equal torch.nn.utils.clip_grad_norm_; no kernel reads a value on the host."""

from __future__ import annotations

import pytest
import torch

from disco_ray.graph.errors import GraphError
from disco_ray.graph.kernels_optim import KERNELS
from disco_ray.graph.kernels_sample import as_bits
from disco_ray.graph.taskgraph import TaskGraph
from tests.test_ops_train import _run

FACTORS = [0.0, 0.25, 1.0, 0.7071067811865476]  # a warmup's first steps, then a cosine's values


def _factor(x: float) -> torch.Tensor:
    return as_bits(torch.tensor([x], dtype=torch.float64))


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adamw_with_a_factor_equals_torch_under_lambda_lr(weight_decay):
    gen = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(5, 7, generator=gen), [torch.randn(5, 7, generator=gen) for _ in FACTORS]
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=3e-3, weight_decay=weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: FACTORS[k] if k < len(FACTORS) else 1.0)
    state = torch.cat([p0, torch.zeros(10, 7)])
    for t, (f, g) in enumerate(zip(FACTORS, grads), 1):
        param.grad = g.clone()
        opt.step()
        sched.step()
        state = _run("adamw", [state, g, torch.tensor([t]), _factor(f)], lr=3e-3, weight_decay=weight_decay)
        assert torch.equal(state[:5], param.detach()), t


def test_sgd_with_a_factor_equals_torch_under_lambda_lr():
    gen = torch.Generator().manual_seed(1)
    p0, grads = torch.randn(5, 7, generator=gen), [torch.randn(5, 7, generator=gen) for _ in FACTORS]
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([param], lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: FACTORS[k] if k < len(FACTORS) else 1.0)
    p = p0.clone()
    for f, g in zip(FACTORS, grads):
        param.grad = g.clone()
        opt.step()
        sched.step()
        p = _run("sgd", [p, g, _factor(f)], lr=0.1, weight_decay=0.01)
        assert torch.equal(p, param.detach())


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clipping_ops_equal_clip_grad_norm_(max_norm):
    gen = torch.Generator().manual_seed(2)
    grads = [
        torch.randn(4, 3, generator=gen) * 0.2,
        torch.randn(6, 2, generator=gen),
        torch.randn(3, generator=gen),
    ]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(params, max_norm)
    sq = [_run("sum_squares", [g]) for g in grads]
    both = _run("clip_coef", [sq[0], _run("add", [sq[1], sq[2]])], max_norm=max_norm)  # two GPUs' sums
    torch.testing.assert_close(both[0], want, rtol=1e-6, atol=0)
    assert (both[1] == 1.0) == (max_norm == 100.0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(_run("scale_grad", [g, both]), p.grad, rtol=1e-6, atol=0)
    half = _run("scale_grad", [grads[0].bfloat16(), both])  # the grad's dtype kept
    assert half.dtype == torch.bfloat16


def test_clipping_kernels_run_on_meta_tensors():
    for op, shapes in {
        "sum_squares": [(2, 4)],
        "clip_coef": [(1,), (1,)],
        "scale_grad": [(2, 4), (2,)],
    }.items():
        ins = [torch.empty(s, device="meta") for s in shapes]
        out = torch.empty(
            (1,) if op == "sum_squares" else (2,) if op == "clip_coef" else (2, 4), device="meta"
        )
        KERNELS[op](out, ins, {"max_norm": 1.0})


def test_bad_factor_and_clip_operands_are_refused():
    g = TaskGraph()
    x, s = g.input("x", (2, 4)), g.input("s", (6, 4))
    step, f32 = g.input("t", (1,)), g.input("f", (1,))
    with pytest.raises(GraphError, match=r"lr factor must be int64 \[1\]"):
        g.kernel("adamw", s, x, step, f32, lr=0.1)
    with pytest.raises(GraphError, match=r"lr factor must be int64 \[1\]"):
        g.kernel("sgd", x, x, f32, lr=0.1)
    with pytest.raises(GraphError, match=r"clip must be float32 \[2\]"):
        g.kernel("scale_grad", x, f32)
    with pytest.raises(GraphError, match="attribute max_norm must satisfy"):
        g.kernel("clip_coef", f32, max_norm=-1.0)
