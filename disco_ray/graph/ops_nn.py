"""The general neural-network ops a model from torch needs (`disco_ray.frontend` maps aten onto
them): activations, layer norm, broadcasting arithmetic, shape copies, reductions, attention on
[.., heads, t, d] tensors and dtype casts. Pure: arity, attributes, shape/dtype inference, FLOPs.

Kernels live in `kernels_nn`. A view in torch (reshape, permute) is a copy here: every TaskGraph
value has its own bytes in the arena.
"""

from __future__ import annotations

import math

from .dtypes import ITEMSIZE
from .opspec import REQUIRED, OpSpec, Shape, _same_dtype, elementwise, numel, reduce_flops, register

GELU_FORMS = ("none", "tanh")


def broadcast(name: str, shapes: list[Shape]) -> Shape:
    """The shape numpy broadcasting gives `shapes`; ValueError names the op when they do not fit."""
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(1, rank + 1):
        sizes = {s[-d] for s in shapes if len(s) >= d} - {1}
        if len(sizes) > 1:
            raise ValueError(f"{name}: shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(reversed(out))


def _axis(name: str, axis: object, rank: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -rank <= axis < max(rank, 1):
        raise ValueError(f"{name}: axis {axis!r} out of range for rank {rank}")
    return axis % max(rank, 1)


def _number(name: str, attrs, key: str) -> float:
    x = attrs[key]
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{name}: attribute {key} must be a finite number, got {x!r}")
    return float(x)


def _infer_unary(name: str):
    def infer(shapes, dtypes, attrs):
        return shapes[0], _same_dtype(name, dtypes)

    return infer


def _infer_gelu(shapes, dtypes, attrs):
    if attrs["approximate"] not in GELU_FORMS:
        raise ValueError(f"gelu: approximate must be one of {GELU_FORMS}, got {attrs['approximate']!r}")
    return shapes[0], _same_dtype("gelu", dtypes)


def _infer_add_scalar(shapes, dtypes, attrs):
    _number("add_scalar", attrs, "value")
    return shapes[0], _same_dtype("add_scalar", dtypes)


def _infer_binary(name: str):
    def infer(shapes, dtypes, attrs):
        return broadcast(name, shapes), _same_dtype(name, dtypes, floats=name == "div")

    return infer


def _infer_layernorm(shapes, dtypes, attrs):
    x = shapes[0]
    if not x:
        raise ValueError("layernorm needs rank >= 1")
    for s in shapes[1:]:
        if s != (x[-1],):
            raise ValueError(f"layernorm: weight and bias must have shape [{x[-1]}], got {list(s)}")
    _number("layernorm", attrs, "eps")
    return x, _same_dtype("layernorm", dtypes)


def _infer_reshape(shapes, dtypes, attrs):
    (x,) = shapes
    shape = attrs["shape"]
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"reshape: attribute shape must be a list of sizes >= 0, got {shape!r}")
    if numel(tuple(shape)) != numel(x):
        raise ValueError(f"reshape: {list(x)} has {numel(x)} elements, shape {list(shape)} {numel(shape)}")
    return tuple(shape), dtypes[0]


def _infer_permute(shapes, dtypes, attrs):
    (x,) = shapes
    dims = attrs["dims"]
    if not isinstance(dims, (list, tuple)) or sorted(dims) != list(range(len(x))):
        raise ValueError(f"permute: dims must be a permutation of 0..{len(x) - 1}, got {dims!r}")
    return tuple(x[d] for d in dims), dtypes[0]


def reduced_axes(name: str, x: Shape, axes: object) -> list[int]:
    """The distinct non-negative axes of `x` that `axes` (a list of ints) names."""
    if not isinstance(axes, (list, tuple)) or not axes:
        raise ValueError(f"{name}: attribute axes must be a non-empty list of ints, got {axes!r}")
    out = sorted({_axis(name, a, len(x)) for a in axes})
    if len(out) != len(axes):
        raise ValueError(f"{name}: axes {list(axes)} name one axis twice")
    return out


def _infer_reduce(name: str):
    def infer(shapes, dtypes, attrs):
        (x,) = shapes
        axes = reduced_axes(name, x, attrs["axes"])
        if not isinstance(attrs["keepdim"], bool):
            raise ValueError(f"{name}: keepdim must be true or false, got {attrs['keepdim']!r}")
        out = (
            [1 if d in axes else n for d, n in enumerate(x)]
            if attrs["keepdim"]
            else [n for d, n in enumerate(x) if d not in axes]
        )
        return tuple(out), _same_dtype(name, dtypes, floats=name == "mean")

    return infer


def _infer_sdpa(shapes, dtypes, attrs):
    q, k, v = shapes
    if len(q) < 2 or len(k) != len(q) or len(v) != len(q):
        raise ValueError(f"sdpa needs q, k, v of one rank >= 2, got {[list(s) for s in shapes]}")
    if q[:-2] != k[:-2] or k[:-1] != v[:-1] or q[-1] != k[-1]:
        raise ValueError(
            f"sdpa: q [.., tq, d], k [.., tk, d], v [.., tk, dv] with equal leading dims, got "
            f"{[list(s) for s in shapes]}"
        )
    if not isinstance(attrs["causal"], bool):
        raise ValueError(f"sdpa: causal must be true or false, got {attrs['causal']!r}")
    if attrs["scale"] is not None:
        _number("sdpa", attrs, "scale")
    return (*q[:-1], v[-1]), _same_dtype("sdpa", dtypes)


def _flops_sdpa(shapes, out, attrs):
    q, k = shapes[0], shapes[1]
    return 2.0 * numel(q[:-1]) * k[-2] * (q[-1] + out[-1])


def _infer_cast(shapes, dtypes, attrs):
    if attrs["dtype"] not in ITEMSIZE:
        raise ValueError(f"cast: unknown dtype {attrs['dtype']!r} (one of {', '.join(ITEMSIZE)})")
    return shapes[0], attrs["dtype"]


def _free(shapes, out, attrs) -> float:
    return 0.0


for _name, _k, _doc in (
    ("relu", 1, "max(x, 0)"),
    ("tanh", 4, "tanh(x)"),
    ("sigmoid", 4, "1 / (1 + exp(-x))"),
):
    register(OpSpec(_name, 1, 1, _infer_unary(_name), flops=elementwise(_k), doc=_doc))
register(
    OpSpec(
        "gelu",
        1,
        1,
        _infer_gelu,
        attrs={"approximate": "none"},
        flops=elementwise(8),
        doc="x * Phi(x) (approximate 'none': the exact erf form; 'tanh': "
        "0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))))",
    )
)
register(
    OpSpec(
        "add_scalar",
        1,
        1,
        _infer_add_scalar,
        attrs={"value": REQUIRED},
        flops=elementwise(1),
        doc="x + value",
    )
)
for _name, _doc in (("sub", "a - b"), ("div", "a / b")):
    register(
        OpSpec(
            _name,
            2,
            2,
            _infer_binary(_name),
            flops=elementwise(1),
            doc=f"elementwise {_doc}, broadcast as numpy does (e.g. b [n] against a [.., n])",
        )
    )
register(
    OpSpec(
        "layernorm",
        1,
        3,
        _infer_layernorm,
        attrs={"eps": 1e-5},
        flops=elementwise(8),
        doc="(x - mean) / sqrt(var + eps) over the last dim [* w [+ b]] (torch.nn.LayerNorm)",
    )
)
register(
    OpSpec(
        "reshape",
        1,
        1,
        _infer_reshape,
        attrs={"shape": REQUIRED},
        flops=_free,
        doc="a copy of x with another shape of as many elements (row-major order)",
    )
)
register(
    OpSpec(
        "permute",
        1,
        1,
        _infer_permute,
        attrs={"dims": REQUIRED},
        flops=_free,
        doc="a copy of x with its dims reordered: result dim i is x's dim dims[i]",
    )
)
for _name in ("sum", "mean"):
    register(
        OpSpec(
            _name,
            1,
            1,
            _infer_reduce(_name),
            attrs={"axes": REQUIRED, "keepdim": False},
            flops=reduce_flops,
            doc=f"{_name} over the dims in axes (kept as size 1 when keepdim)",
        )
    )
register(
    OpSpec(
        "sdpa",
        3,
        3,
        _infer_sdpa,
        attrs={"causal": False, "scale": None},
        flops=_flops_sdpa,
        doc="scaled dot-product attention of q [.., tq, d], k [.., tk, d], v [.., tk, dv]: "
        "softmax(q k^T * scale [+ causal mask]) v, scale None: 1/sqrt(d) "
        "(torch's F.scaled_dot_product_attention on [batch, heads, t, d])",
    )
)
register(
    OpSpec(
        "cast",
        1,
        1,
        _infer_cast,
        attrs={"dtype": REQUIRED},
        flops=elementwise(1),
        doc="x converted to dtype",
    )
)

__all__ = ["GELU_FORMS", "broadcast", "reduced_axes"]
