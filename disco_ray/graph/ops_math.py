"""Elementwise math, scans and constants a torch model maps onto beyond `ops_nn`: `rsqrt`
(RMSNorm written out), `sqrt`, `exp`, `sin`, `cos` (rotary tables), log_softmax, leaky_relu,
hardswish, powers (`pow_scalar` x ** e for any real e, `pow` a ** b elementwise, `scalar_pow`
base ** x), `cumsum`, and `full` (a constant tensor made on the GPU, no operand: torch's zeros,
ones, full). Pure: arity, attributes, shape/dtype inference, FLOPs; kernels live in
`kernels_math` (the unary math) and `kernels_conv` (the rest).
"""

from __future__ import annotations

import math

from .dtypes import ITEMSIZE
from .ops_nn import broadcast, reduced_axes
from .opspec import ATTR_TYPES, REQUIRED, OpSpec, _is_real, _same_dtype, elementwise, no_flops, register


def _number(name: str, attrs, key: str) -> float:
    x = attrs[key]
    if not _is_real(x):
        raise ValueError(f"{name}: attribute {key} must be a finite number, got {x!r}")
    return float(x)


def _infer_log_softmax(shapes, dtypes, attrs):
    (s,) = shapes
    if not s:
        raise ValueError("log_softmax needs rank >= 1, got a scalar")
    reduced_axes("log_softmax", s, [attrs["axis"]])
    return s, _same_dtype("log_softmax", dtypes)


def _infer_float_unary(name: str, key: str | None = None):
    def infer(shapes, dtypes, attrs):
        if key is not None:
            _number(name, attrs, key)
        return shapes[0], _same_dtype(name, dtypes)

    return infer


def _infer_pow_scalar(shapes, dtypes, attrs):
    e = _number("pow_scalar", attrs, "exponent")
    return shapes[0], _same_dtype("pow_scalar", dtypes, floats=not (e.is_integer() and e >= 0))


def _infer_pow(shapes, dtypes, attrs):
    return broadcast("pow", shapes), _same_dtype("pow", dtypes)


def _infer_cumsum(shapes, dtypes, attrs):
    (s,) = shapes
    reduced_axes("cumsum", s if s else (1,), [attrs["axis"]])
    return s, _same_dtype("cumsum", dtypes, floats=False)


def _infer_full(shapes, dtypes, attrs):
    shape, dtype, value = attrs["shape"], attrs["dtype"], attrs["value"]
    if dtype not in ITEMSIZE:
        raise ValueError(f"full: dtype must be one of {', '.join(ITEMSIZE)}, got {dtype!r}")
    if not _full_value(value):
        raise ValueError(f"full: value must be a number (not NaN), got {value!r}")
    return tuple(shape), dtype


def _full_value(x: object) -> bool:
    # -inf is a usual fill (a mask); NaN is not one
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


ATTR_TYPES[("full", "value")] = (_full_value, "a number (not NaN)")

register(
    OpSpec(
        "log_softmax",
        1,
        1,
        _infer_log_softmax,
        attrs={"axis": -1},
        flops=elementwise(5),
        doc="log(softmax(x)) over dim axis, computed as torch's log_softmax (x - max - log sum exp)",
    )
)
register(
    OpSpec(
        "leaky_relu",
        1,
        1,
        _infer_float_unary("leaky_relu", "slope"),
        attrs={"slope": 0.01},
        flops=elementwise(2),
        doc="x where x > 0, else slope * x",
    )
)
register(
    OpSpec(
        "hardswish",
        1,
        1,
        _infer_float_unary("hardswish"),
        flops=elementwise(4),
        doc="x * relu6(x + 3) / 6 (MobileNetV3's)",
    )
)
register(
    OpSpec(
        "pow_scalar",
        1,
        1,
        _infer_pow_scalar,
        attrs={"exponent": REQUIRED},
        flops=elementwise(4),
        doc="x ** exponent for any finite real exponent (torch.pow(x, e); an integer x to a power "
        "0, 1, 2, ...)",
    )
)
register(
    OpSpec(
        "scalar_pow",
        1,
        1,
        _infer_float_unary("scalar_pow", "base"),
        attrs={"base": REQUIRED},
        flops=elementwise(4),
        doc="base ** x elementwise (torch.pow(base, x))",
    )
)
register(
    OpSpec(
        "pow",
        2,
        2,
        _infer_pow,
        flops=elementwise(4),
        doc="a ** b elementwise, shapes broadcast as numpy's do (torch.pow(a, b))",
    )
)
register(
    OpSpec(
        "cumsum",
        1,
        1,
        _infer_cumsum,
        attrs={"axis": -1},
        flops=elementwise(1),
        doc="the running sum of x along dim axis, in x's dtype (torch.cumsum)",
    )
)
register(
    OpSpec(
        "full",
        0,
        0,
        _infer_full,
        attrs={"shape": REQUIRED, "value": 0.0, "dtype": "float32"},
        flops=no_flops,
        doc="a tensor of shape and dtype with every element value, made on its GPU from no operand "
        "(torch's zeros, ones, full and their _like and new_ forms)",
    )
)


UNARY = {"rsqrt": "1 / sqrt(x)", "sqrt": "sqrt(x)", "exp": "e^x", "sin": "sin(x)", "cos": "cos(x)"}


def _infer_unary(name: str):
    def infer(shapes, dtypes, attrs):
        return shapes[0], _same_dtype(name, dtypes)

    return infer


for _name, _doc in UNARY.items():
    register(OpSpec(_name, 1, 1, _infer_unary(_name), flops=elementwise(4), doc=f"{_doc} elementwise"))
