"""The integer and boolean ops of attention masks and positions, as a torch model computes them:
comparisons, logical ops, `where`, advanced indexing (`index`), broadcasting copies (`expand`),
and attention with a mask (`sdpa_mask`). Pure: arity, attributes, shape/dtype inference, FLOPs;
kernels live in `kernels_mask`.

Operands of a comparison or a logical op share one dtype (the frontend casts them to the one
torch promotes to); their result is `bool`.
"""

from __future__ import annotations

from .ops_nn import broadcast
from .opspec import REQUIRED, OpSpec, Shape, _same_dtype, elementwise, no_flops, numel, register

COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
LOGICAL = {"logical_and": "and", "logical_or": "or", "logical_xor": "xor"}
INDEX_DTYPES = ("int32", "int64")


def _infer_compare(name: str):
    def infer(shapes, dtypes, attrs):
        out = broadcast(name, shapes)
        _same_dtype(name, dtypes, floats=False)
        return out, "bool"

    return infer


def _infer_not(shapes, dtypes, attrs):
    return shapes[0], "bool"


def _infer_where(shapes, dtypes, attrs):
    if dtypes[0] != "bool":
        raise ValueError(f"where: the condition must be bool, got {dtypes[0]}")
    return broadcast("where", shapes), _same_dtype("where", dtypes[1:], floats=False)


def index_shape(x: Shape, dims: list[int], idx: list[Shape]) -> Shape:
    """numpy's advanced indexing of `x` by index arrays of shapes `idx` along `dims` (increasing):
    the broadcast index shape replaces the indexed dims where they are adjacent, else leads."""
    b = broadcast("index", idx)
    rest = [n for d, n in enumerate(x) if d not in dims]
    if dims == list(range(dims[0], dims[-1] + 1)):
        return (*x[: dims[0]], *b, *x[dims[-1] + 1 :])
    return (*b, *rest)


def _infer_index(shapes, dtypes, attrs):
    x, idx = shapes[0], shapes[1:]
    dims = list(attrs["dims"])
    if len(dims) != len(idx) or dims != sorted(set(dims)) or not all(0 <= d < len(x) for d in dims):
        raise ValueError(
            f"index: dims {dims} must be {len(idx)} increasing dims of x {list(x)}, one per index operand"
        )
    if any(dt not in INDEX_DTYPES for dt in dtypes[1:]):
        raise ValueError(f"index: index operands must be one of {INDEX_DTYPES}, got {dtypes[1:]}")
    return index_shape(x, dims, list(idx)), dtypes[0]


def _infer_expand(shapes, dtypes, attrs):
    (x,) = shapes
    shape = tuple(attrs["shape"])
    if len(shape) < len(x) or broadcast("expand", [x, shape]) != shape:
        raise ValueError(f"expand: {list(x)} does not broadcast to {list(shape)}")
    return shape, dtypes[0]


def _infer_sdpa_mask(shapes, dtypes, attrs):
    q, k, v, m = shapes
    if len(q) < 2 or len(k) != len(q) or len(v) != len(q):
        raise ValueError(f"sdpa_mask needs q, k, v of one rank >= 2, got {[list(s) for s in shapes[:3]]}")
    if q[:-2] != k[:-2] or k[:-1] != v[:-1] or q[-1] != k[-1]:
        raise ValueError(
            f"sdpa_mask: q [.., tq, d], k [.., tk, d], v [.., tk, dv] with equal leading dims, got "
            f"{[list(s) for s in shapes[:3]]}"
        )
    scores = (*q[:-1], k[-2])
    if len(m) > len(scores) or broadcast("sdpa_mask", [scores, m]) != scores:
        raise ValueError(f"sdpa_mask: mask {list(m)} does not broadcast to the scores {list(scores)}")
    dt = _same_dtype("sdpa_mask", dtypes[:3])
    if dtypes[3] not in ("bool", dt):
        raise ValueError(f"sdpa_mask: the mask must be bool or {dt}, got {dtypes[3]}")
    return (*q[:-1], v[-1]), dt


def _flops_sdpa_mask(shapes, out, attrs):
    q, k = shapes[0], shapes[1]
    return 2.0 * numel(q[:-1]) * k[-2] * (q[-1] + out[-1])


for _name, _sym in COMPARE.items():
    register(
        OpSpec(
            _name,
            2,
            2,
            _infer_compare(_name),
            flops=elementwise(1),
            doc=f"a {_sym} b elementwise as bool (operands of one dtype, broadcast as numpy's)",
        )
    )
for _name, _sym in LOGICAL.items():
    register(
        OpSpec(
            _name,
            2,
            2,
            _infer_compare(_name),
            flops=elementwise(1),
            doc=f"a {_sym} b elementwise as bool, nonzero being true (torch's {_name}; `&` `|` `^` "
            "of bool tensors)",
        )
    )
register(
    OpSpec(
        "logical_not", 1, 1, _infer_not, flops=elementwise(1), doc="not x elementwise as bool (`~` of bool)"
    )
)
register(
    OpSpec(
        "where",
        3,
        3,
        _infer_where,
        flops=elementwise(1),
        doc="cond ? a : b elementwise: cond bool, a and b of one dtype, all three broadcast",
    )
)
register(
    OpSpec(
        "index",
        2,
        None,
        _infer_index,
        attrs={"dims": REQUIRED},
        flops=no_flops,
        doc="x[.., i, .., j, ..]: torch's advanced indexing of x by integer tensors i, j, ... along "
        "dims (increasing), the index shapes broadcast",
    )
)
register(
    OpSpec(
        "expand",
        1,
        1,
        _infer_expand,
        attrs={"shape": REQUIRED},
        flops=no_flops,
        doc="a copy of x broadcast to shape (torch's expand, materialized)",
    )
)
register(
    OpSpec(
        "sdpa_mask",
        4,
        4,
        _infer_sdpa_mask,
        attrs={"scale": REQUIRED},
        flops=_flops_sdpa_mask,
        doc="scaled dot-product attention of q [.., tq, d], k [.., tk, d], v [.., tk, dv] with a "
        "mask broadcasting to [.., tq, tk]: bool (true: attend) or added to the scores "
        "(torch's F.scaled_dot_product_attention with attn_mask)",
    )
)

__all__ = ["COMPARE", "INDEX_DTYPES", "LOGICAL", "index_shape"]
