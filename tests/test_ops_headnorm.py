"""The per-head RMSNorm ops against torch: `head_rmsnorm` against transformers' RMSNorm of each
head (x viewed [.., heads, d]), `head_rmsnorm_grad` against autograd of it, per dtype; both on
meta tensors (no host read); bad shapes refused naming the op."""

from __future__ import annotations

import pytest
import torch

from disco_ray.graph.errors import GraphError
from disco_ray.graph.kernels import run_kernel
from disco_ray.graph.taskgraph import TaskGraph
from tests.test_ops_train import DTYPES, _close, _grad, _randn, _run


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm on x viewed as heads of len(w), in float32, cast back."""
    d = w.shape[0]
    h = x.float().unflatten(-1, (-1, d))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * h).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rmsnorm_normalizes_each_head_with_the_shared_weight(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = _randn(5, 3 * 8, g=g, dtype=dtype) * 3, _randn(8, g=g, dtype=dtype)
    _close(_run("head_rmsnorm", [x, w], eps=1e-6), _reference(x, w, 1e-6).to(dtype).float(), dtype)


def test_head_rmsnorm_is_not_a_norm_over_the_whole_row():
    # heads of very different scales: one norm over the row would leave them unequal
    x = torch.cat([torch.ones(2, 4), 100 * torch.ones(2, 4)], dim=1)
    got = _run("head_rmsnorm", [x, torch.ones(4)], eps=0.0)
    torch.testing.assert_close(got, torch.ones(2, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rmsnorm_grad_is_autograd_of_head_rmsnorm_with_a_frozen_weight(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = _randn(2, 5, 4 * 16, g=g, dtype=dtype), _randn(16, g=g, dtype=dtype)
    dy = _randn(2, 5, 4 * 16, g=g, dtype=dtype)
    (want,) = _grad(lambda a: _reference(a, w.float(), 1e-5), x, dy=dy)
    _close(_run("head_rmsnorm_grad", [x, w, dy], eps=1e-5), want, dtype)


@pytest.mark.parametrize(
    "op, shapes", [("head_rmsnorm", [(3, 16), (8,)]), ("head_rmsnorm_grad", [(3, 16), (8,), (3, 16)])]
)
def test_the_kernels_read_no_data_on_the_host(op, shapes):
    ins = [torch.empty(s, device="meta") for s in shapes]
    run_kernel(op, torch.empty(3, 16, device="meta"), ins, {"eps": 1e-6})


def test_bad_shapes_are_refused_naming_the_op():
    g = TaskGraph(1)
    x, w8, w5 = g.input("x", (3, 16)), g.input("w8", (8,)), g.input("w5", (5,))
    with pytest.raises(GraphError, match=r"head_rmsnorm needs x \[\.\., heads\*d\] and w \[d\]"):
        g.kernel("head_rmsnorm", x, w5)
    with pytest.raises(GraphError, match=r"head_rmsnorm_grad: dy \[3, 8\] must be shaped as x"):
        g.kernel("head_rmsnorm_grad", x, w8, g.input("dy", (3, 8)))
    assert g[g.kernel("head_rmsnorm", x, w8, eps=1e-5)].shape == (3, 16)
