"""The general ops (`ops_nn`, and add/mul/linear/softmax/embedding widened), each against torch in
float32 and bfloat16: activations, layer norm, broadcasting arithmetic, shape copies, slices and
splits, reductions, attention on [batch, heads, t, d], casts; and the shape checks' messages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disco_ray.graph import ops
from disco_ray.graph.errors import GraphError
from disco_ray.graph.kernels import IMPLS, run_kernel, temp_bytes
from disco_ray.graph.reference import evaluate
from disco_ray.graph.taskgraph import TaskGraph

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _run(op: str, ins: list[torch.Tensor], **attrs) -> torch.Tensor:
    """The op's inferred shape and dtype, then its kernel into a fresh output."""
    spec = ops.OPS[op]
    full = spec.full_attrs(attrs)
    shape, dtype = spec.infer([tuple(t.shape) for t in ins], [_name(t.dtype) for t in ins], full)
    out = torch.full(shape, float("nan")).to(getattr(torch, dtype))  # a kernel must write all of it
    run_kernel(op, out, ins, attrs)
    return out


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = {
    "relu": (lambda x: [x], {}, lambda x: F.relu(x)),
    "gelu": (lambda x: [x], {}, lambda x: F.gelu(x)),
    "gelu_tanh": (lambda x: [x], {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
    "tanh": (lambda x: [x], {}, torch.tanh),
    "sigmoid": (lambda x: [x], {}, torch.sigmoid),
    "add_scalar": (lambda x: [x], {"value": 0.75}, lambda x: x + 0.75),
    "softmax": (lambda x: [x], {"axis": 1}, lambda x: torch.softmax(x, 1)),
    "reshape": (lambda x: [x], {"shape": [6, 20]}, lambda x: x.reshape(6, 20)),
    "permute": (lambda x: [x], {"dims": [2, 0, 1]}, lambda x: x.permute(2, 0, 1).contiguous()),
    "sum": (lambda x: [x], {"axes": [0, 2]}, lambda x: x.sum((0, 2))),
    "mean": (lambda x: [x], {"axes": [1], "keepdim": True}, lambda x: x.mean(1, keepdim=True)),
    "cast": (lambda x: [x], {"dtype": "float32"}, lambda x: x.float()),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_unary_ops_match_torch(case, dtype):
    x = _rand(2, 3, 20, dtype=dtype) * 3
    ins, attrs, want = CASES[case]
    op = "gelu" if case.startswith("gelu") else case
    torch.testing.assert_close(_run(op, ins(x), **attrs), want(x), **TOL[dtype])


def test_the_two_gelu_forms_differ():
    x = torch.linspace(-4, 4, 101)
    assert not torch.equal(_run("gelu", [x]), _run("gelu", [x], approximate="tanh"))
    with pytest.raises(ValueError, match="attribute approximate must be"):
        _run("gelu", [x], approximate="erf")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("op", "fn"), [("add", torch.add), ("sub", torch.sub), ("mul", torch.mul), ("div", torch.div)]
)
def test_binary_ops_broadcast_as_torch(op, fn, dtype):
    x = _rand(4, 3, 8, dtype=dtype)
    for other in (_rand(8, dtype=dtype, seed=1), _rand(4, 1, 8, dtype=dtype, seed=2), _rand(1, 3, 1, seed=3)):
        other = other.to(dtype) + 2.0  # away from zero: div
        torch.testing.assert_close(_run(op, [x, other]), fn(x, other), **TOL[dtype])
        torch.testing.assert_close(_run(op, [other, x]), fn(other, x), **TOL[dtype])
    with pytest.raises(ValueError, match=rf"{op}: shapes \[\[4, 3, 8\], \[3\]\] do not broadcast"):
        _run(op, [x, _rand(3, dtype=dtype)])


def test_add_of_several_operands_broadcasts_too():
    x, b, c = _rand(5, 4), _rand(4, seed=1), _rand(5, 1, seed=2)
    torch.testing.assert_close(_run("add", [x, b, c]), x + b + c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_matches_torch_with_and_without_affine(dtype):
    x, w, b = (
        _rand(3, 5, 16, dtype=dtype) * 4 + 1,
        _rand(16, dtype=dtype, seed=1),
        _rand(16, dtype=dtype, seed=2),
    )
    torch.testing.assert_close(_run("layernorm", [x, w, b], eps=1e-6), F.layer_norm(x, (16,), w, b, 1e-6))
    torch.testing.assert_close(_run("layernorm", [x, w]), F.layer_norm(x, (16,), w), **TOL[dtype])
    torch.testing.assert_close(_run("layernorm", [x]), F.layer_norm(x, (16,)), **TOL[dtype])
    with pytest.raises(ValueError, match=r"weight and bias must have shape \[16\]"):
        _run("layernorm", [x, _rand(8, dtype=dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_with_bias_and_embedding_of_a_batch(dtype):
    x, w, b = _rand(2, 5, 8, dtype=dtype), _rand(3, 8, dtype=dtype, seed=1), _rand(3, dtype=dtype, seed=2)
    torch.testing.assert_close(_run("linear", [x, w, b]), F.linear(x, w, b), **TOL[dtype])
    table = _rand(10, 4, dtype=dtype)
    ids = torch.tensor([[0, 9, 3], [4, 4, 7]])
    torch.testing.assert_close(_run("embedding", [ids, table]), F.embedding(ids, table))
    with pytest.raises(ValueError, match=r"the bias must have shape \[3\]"):
        _run("linear", [x, w, _rand(8, dtype=dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch_on_batch_heads_t_d(causal, dtype):
    q, k, v = (_rand(2, 4, 6, 8, dtype=dtype, seed=s) for s in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(_run("sdpa", [q, k, v], causal=causal), want, **TOL[dtype])
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(_run("sdpa", [q, k, v], scale=0.3), want, **TOL[dtype])


def test_slice_and_split_cut_what_torch_cuts():
    g = TaskGraph()
    x = g.input("x", (4, 10))
    parts = g.split(x, [3, 3, 4], axis=1)
    g.output(*parts, g.slice(x, 0, 1, 3))
    t = _rand(4, 10)
    got = evaluate(g, {"x": t})
    for p, want in zip(parts, torch.split(t, [3, 3, 4], dim=1)):
        torch.testing.assert_close(got[p], want)
    torch.testing.assert_close(got[g.outputs[-1]], t[1:3])


def test_a_bias_add_in_a_graph_needs_no_materialised_bias():
    g = TaskGraph()
    x, w, b = g.input("x", (6, 8)), g.input("w", (4, 8)), g.input("b", (4,))
    y = g.relu(g.add(g.linear(x, w), b))
    g.output(g.mean(y, 0))
    ins = {"x": _rand(6, 8), "w": _rand(4, 8, seed=1), "b": _rand(4, seed=2)}
    torch.testing.assert_close(
        evaluate(g, ins)[g.outputs[0]], F.relu(F.linear(ins["x"], ins["w"], ins["b"])).mean(0)
    )


@pytest.mark.parametrize(
    ("op", "shapes", "attrs", "msg"),
    [
        ("reshape", [(2, 3)], {"shape": [4, 2]}, r"has 6 elements, shape \[4, 2\] 8"),
        ("permute", [(2, 3)], {"dims": [0, 0]}, "must be a permutation of 0..1"),
        ("sum", [(2, 3)], {"axes": [2]}, "axis 2 out of range for rank 2"),
        ("mean", [(2, 3)], {"axes": [1, -1]}, "name one axis twice"),
        ("sdpa", [(2, 4, 8), (2, 5, 7), (2, 5, 8)], {}, "equal leading dims"),
        ("cast", [(2,)], {"dtype": "float64"}, "attribute dtype must be one of .*got 'float64'"),
        ("softmax", [(2, 3)], {"axis": 2}, "axis 2 out of range"),
    ],
)
def test_shape_checks_name_the_problem(op, shapes, attrs, msg):
    g = TaskGraph()
    ins = [g.input(f"x{i}", s) for i, s in enumerate(shapes)]
    with pytest.raises(GraphError, match=msg):
        g.kernel(op, *ins, **attrs)


def test_every_op_has_a_kernel_and_a_temporaries_bound():
    assert sorted(set(ops.OPS) - set(IMPLS)) == []
    out = torch.empty(2, 4, 6, 6)
    q = torch.empty(2, 4, 6, 8)
    assert temp_bytes("sdpa", out, [q, q, q], {}) >= 2 * 2 * 4 * 6 * 6 * 4  # scores and probabilities
    assert temp_bytes("relu", out, [out], {}) == 0
