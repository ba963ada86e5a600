"""The CNN ops (`ops_conv`) and those of `ops_math`, each against the torch function a module's
forward calls, in float32 and bfloat16: convolutions with stride, padding, dilation, groups and
bias over 1 to 3 dims, batch norm in eval mode, max/avg/adaptive pooling (ceil mode, padding),
group norm, log_softmax, leaky_relu, hardswish, powers, cumsum and full; the shape inference
against torch's own output shapes, and the refusals of operands that do not fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disco_ray.graph import ops
from disco_ray.graph.kernels import run_kernel, temp_bytes

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _run(op: str, ins: list[torch.Tensor], **attrs) -> torch.Tensor:
    """The op's inferred shape and dtype, then its kernel into a NaN-filled output (all written)."""
    spec = ops.OPS[op]
    full = spec.full_attrs(attrs)
    names = [str(t.dtype).removeprefix("torch.") for t in ins]
    shape, dtype = spec.infer([tuple(t.shape) for t in ins], names, full)
    dt = getattr(torch, dtype)
    out = torch.full(shape, float("nan") if dt.is_floating_point else -7, dtype=dt)
    run_kernel(op, out, ins, attrs)
    assert temp_bytes(op, out, ins, full) >= 0
    return out


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


CONVS = [  # (x shape, w shape, bias, stride, padding, dilation, groups)
    ((2, 4, 11), (6, 4, 3), True, 1, 0, 1, 1),
    ((2, 4, 11), (6, 2, 3), False, 2, 2, 2, 2),
    ((1, 3, 9, 10), (8, 3, 3, 3), True, [2, 1], [1, 2], 1, 1),
    ((2, 6, 8, 8), (6, 1, 3, 3), True, 1, 1, [1, 2], 6),  # depthwise, dilated
    ((1, 4, 7, 7), (4, 2, 1, 1), False, 2, 0, 1, 2),
    ((1, 2, 5, 6, 7), (3, 2, 2, 3, 3), True, [1, 2, 1], 1, 1, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CONVS)))
def test_conv_is_torch_conv(case, dtype):
    xs, ws, bias, stride, pad, dil, groups = CONVS[case]
    x, w = _rand(*xs, dtype=dtype, seed=1), _rand(*ws, dtype=dtype, seed=2)
    b = _rand(ws[0], dtype=dtype, seed=3) if bias else None
    fn = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[len(xs)]
    want = fn(x, w, b, stride, pad, dil, groups)
    got = _run(
        "conv", [x, w, *([b] if bias else [])], stride=stride, padding=pad, dilation=dil, groups=groups
    )
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_batchnorm_in_eval_mode_uses_the_running_statistics(dtype):
    x = _rand(2, 5, 4, 3, dtype=dtype)
    mean, var = _rand(5, seed=1, dtype=dtype), _rand(5, seed=2).abs().to(dtype) + 0.5
    w, b = _rand(5, seed=3, dtype=dtype), _rand(5, seed=4, dtype=dtype)
    want = F.batch_norm(x, mean, var, w, b, False, 0.1, 1e-3)
    torch.testing.assert_close(_run("batchnorm", [x, mean, var, w, b], eps=1e-3), want, **TOL[dtype])
    plain = F.batch_norm(x, mean, var, None, None, False, 0.1, 1e-5)
    torch.testing.assert_close(_run("batchnorm", [x, mean, var]), plain, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_is_torch_group_norm(dtype):
    x, w, b = _rand(2, 6, 5, 4, dtype=dtype), _rand(6, seed=1, dtype=dtype), _rand(6, seed=2, dtype=dtype)
    torch.testing.assert_close(
        _run("group_norm", [x, w, b], groups=3, eps=1e-4), F.group_norm(x, 3, w, b, 1e-4), **TOL[dtype]
    )
    torch.testing.assert_close(_run("group_norm", [x], groups=2), F.group_norm(x, 2), **TOL[dtype])


POOLS = [  # (kernel, stride, padding, ceil_mode)
    ([3, 3], [2, 2], [1, 1], False),
    ([2, 3], [2, 1], [0, 1], True),
    ([3, 3], [3, 3], [0, 0], True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(POOLS)))
def test_pools_are_torch_pools(case, dtype):
    k, s, p, ceil = POOLS[case]
    x = _rand(2, 3, 10, 11, dtype=dtype)
    want = F.max_pool2d(x, k, s, p, 1, ceil)
    got = _run("max_pool2d", [x], kernel=k, stride=s, padding=p, ceil_mode=ceil)
    assert torch.equal(got, want)
    got = _run("max_pool2d", [x], kernel=k, stride=s, padding=p, dilation=[2, 1], ceil_mode=ceil)
    assert torch.equal(got, F.max_pool2d(x, k, s, p, [2, 1], ceil))
    for incl, div in ((True, None), (False, None), (True, 5)):
        want = F.avg_pool2d(x, k, s, p, ceil, incl, div)
        got = _run(
            "avg_pool2d",
            [x],
            kernel=k,
            stride=s,
            padding=p,
            ceil_mode=ceil,
            count_include_pad=incl,
            divisor=div,
        )
        torch.testing.assert_close(got, want, **TOL[dtype])
    for size in ([1, 1], [3, 4], [7, 5]):
        want = F.adaptive_avg_pool2d(x, size)
        torch.testing.assert_close(_run("adaptive_avg_pool2d", [x], size=size), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_math_is_torchs(dtype):
    x = _rand(4, 7, dtype=dtype) * 3
    pos = x.abs() + 0.1
    cases = [
        ("log_softmax", [x], {"axis": 0}, torch.log_softmax(x, 0)),
        ("log_softmax", [x], {}, torch.log_softmax(x, -1)),
        ("leaky_relu", [x], {"slope": 0.2}, F.leaky_relu(x, 0.2)),
        ("hardswish", [x], {}, F.hardswish(x)),
        ("pow_scalar", [x], {"exponent": 3.0}, x**3),
        ("pow_scalar", [pos], {"exponent": 0.5}, pos**0.5),
        ("pow_scalar", [pos], {"exponent": -1.7}, pos**-1.7),
        ("scalar_pow", [x], {"base": 2.0}, 2.0**x),
        ("pow", [pos, x], {}, pos**x),
        ("pow", [pos, x[:1]], {}, pos ** x[:1]),  # broadcast
        ("cumsum", [x], {"axis": 1}, torch.cumsum(x, 1)),
    ]
    for op, ins, attrs, want in cases:
        got = _run(op, ins, **attrs)
        assert got.dtype == want.dtype, op
        torch.testing.assert_close(
            got, want, **TOL[dtype], msg=lambda m, op=op, attrs=attrs: f"{op} {attrs}: {m}"
        )


def test_cumsum_of_integers_and_full():
    ids = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]])
    assert torch.equal(_run("cumsum", [ids], axis=-1), torch.cumsum(ids, -1))
    got = _run("full", [], shape=[2, 3], value=-float("inf"), dtype="float32")
    assert torch.equal(got, torch.full((2, 3), -float("inf")))
    assert torch.equal(_run("full", [], shape=[4], value=7, dtype="int64"), torch.full((4,), 7))


@pytest.mark.parametrize(
    "op,shapes,attrs,match",
    [
        (
            "conv",
            [(2, 4, 9, 9), (6, 3, 3, 3)],
            {},
            r"x has 4 channels, weight \[6, 3, 3, 3\] with groups=1 wants 3",
        ),
        ("conv", [(2, 4, 9), (6, 2, 3)], {"groups": 3}, r"wants 6"),
        ("conv", [(2, 4, 2, 2), (6, 4, 3, 3)], {}, r"smaller than the \(dilated\) kernel"),
        ("conv", [(2, 4, 9, 9), (6, 4, 3, 3)], {"stride": [1, 0]}, r"stride must be 2 integer\(s\) >= 1"),
        ("conv", [(4, 9, 9), (6, 4, 3, 3)], {}, r"needs x \[N, C, \*, \*\] of rank 4"),
        ("conv", [(2, 4, 9, 9), (6, 4, 3, 3), (5,)], {}, r"bias must have shape \[6\]"),
        ("batchnorm", [(2, 5, 3), (5,), (4,)], {}, r"must have shape \[5\] \(the channels\)"),
        ("group_norm", [(2, 6, 3)], {"groups": 4}, r"groups must divide the 6 channels"),
        ("max_pool2d", [(1, 2, 8, 8)], {"kernel": [2, 2], "padding": [2, 2]}, r"at most half the kernel"),
        ("avg_pool2d", [(1, 2, 2, 2)], {"kernel": [3, 3]}, r"smaller than the kernel"),
        ("avg_pool2d", [(1, 2, 4, 4)], {"divisor": 0}, r"divisor must be null or an integer >= 1"),
        ("log_softmax", [(3, 4)], {"axis": 2}, r"axis 2 out of range"),
        ("pow", [(3, 4), (2, 4)], {}, r"do not broadcast"),
    ],
)
def test_operands_that_do_not_fit_are_refused_naming_why(op, shapes, attrs, match):
    spec = ops.OPS[op]
    with pytest.raises(ValueError, match=match):
        spec.infer(shapes, ["float32"] * len(shapes), spec.full_attrs(attrs))


def test_bad_attributes_are_refused():
    with pytest.raises(ValueError, match=r"value must be a number \(not NaN\)"):
        ops.OPS["full"].full_attrs({"shape": [2], "value": float("nan")})
    with pytest.raises(ValueError, match=r"slope must be a finite number"):
        ops.OPS["leaky_relu"].full_attrs({"slope": float("inf")})
    with pytest.raises(ValueError, match=r"needs attribute 'exponent'"):
        ops.OPS["pow_scalar"].full_attrs({})


def test_flops_count_a_multiply_add_per_weight_of_an_output_channel():
    spec = ops.OPS["conv"]
    shapes = [(2, 4, 9, 9), (6, 2, 3, 3)]
    full = spec.full_attrs({"groups": 2})
    out, _ = spec.infer(shapes, ["float32"] * 2, full)
    assert out == (2, 6, 7, 7)
    assert spec.flops(shapes, out, full) == 2 * (2 * 6 * 7 * 7) * (2 * 3 * 3)
