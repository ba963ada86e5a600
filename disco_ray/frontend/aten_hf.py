"""The ATen ops of masks, positions and rotary tables (Hugging Face causal LMs, attention masks),
registered into `aten.ATEN` beside aten's own handlers.

What depends on shapes and buffers alone is folded before a handler sees it (`fold`); these
handlers map what reads a value of the call: comparisons and logical ops on a padding mask,
`where` / `masked_fill`, advanced indexing, broadcasting copies, attention with a mask, RMSNorm's
`rsqrt`, and arithmetic on integer and boolean tensors. Operands are cast to the dtype torch
promotes to, and Python numbers become constant tensors of it, so each graph op sees one dtype.
"""

from __future__ import annotations

import math

import torch

from disco_ray.graph.dtypes import FLOATS

from . import fold
from .aten import ATEN, Unsupported, handles
from .values import Value


def _meta(v) -> torch.Tensor | int | float | bool:
    """What torch.result_type needs of an operand: a meta tensor of its shape and dtype."""
    return torch.empty(v.shape, dtype=getattr(torch, v.dtype), device="meta") if isinstance(v, Value) else v


def _common(a, b) -> str:
    """The dtype torch computes `a op b` in (type promotion of tensors and Python numbers)."""
    return str(torch.result_type(_meta(a), _meta(b))).removeprefix("torch.")


def _cast(cx, v: Value, dtype: str) -> Value:
    return v if v.dtype == dtype else cx.op("cast", v, dtype=dtype)


def _operand(cx, x, dtype: str) -> Value:
    """`x` as a Value of `dtype`: a Value cast, a Python number as a constant tensor of shape []."""
    if isinstance(x, Value):
        return _cast(cx, x, dtype)
    t = torch.tensor(x, dtype=getattr(torch, dtype))
    return fold.as_value(cx, fold.Const(t, cx.g.fresh(f"{cx.stem}.scalar")))


def _packet(cx) -> str:
    return cx.node.target.overloadpacket.__name__


# ---- comparisons and logical ops --------------------------------------------------------------------
@handles("eq", "ne", "lt", "le", "gt", "ge")
def _compare(cx, a, b):
    dt = _common(a, b)
    return cx.op(_packet(cx), _operand(cx, a, dt), _operand(cx, b, dt))


_LOGICAL = {
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "logical_xor": "logical_xor",
    "__and__": "logical_and",
    "__or__": "logical_or",
    "__xor__": "logical_xor",
    "bitwise_and": "logical_and",
    "bitwise_or": "logical_or",
    "bitwise_xor": "logical_xor",
}


@handles(*_LOGICAL)
def _logical(cx, a, b):
    name = _packet(cx)
    if not name.startswith("logical") and cx.meta()[1] != "bool":
        raise Unsupported(f"of {cx.meta()[1]} tensors (bitwise ops of bool tensors only)")
    dt = _common(a, b) if not name.startswith("logical") else "bool"
    return cx.op(_LOGICAL[name], _operand(cx, a, dt), _operand(cx, b, dt))


@handles("logical_not", "bitwise_not", "__invert__")
def _not(cx, x):
    if _packet(cx) != "logical_not" and x.dtype != "bool":
        raise Unsupported(f"of a {x.dtype} tensor (bitwise not of bool tensors only)")
    return cx.op("logical_not", x)


@handles("where")
def _where(cx, cond, a=None, b=None):
    if a is None:
        raise Unsupported("with the condition alone (nonzero: a data-dependent shape)")
    _, dt = cx.meta()
    return cx.op("where", _cast(cx, cond, "bool"), _operand(cx, a, dt), _operand(cx, b, dt))


@handles("masked_fill", "masked_fill_")
def _masked_fill(cx, x, mask, value):
    if _packet(cx) == "masked_fill_" and len(cx.node.args[0].users) > 1:
        raise Unsupported("in place on a tensor read elsewhere too")
    return cx.op("where", _cast(cx, mask, "bool"), _operand(cx, value, x.dtype), x)


# ---- indexing and broadcasting ----------------------------------------------------------------------
@handles("index")
def _index(cx, x, indices):
    dims = [d for d, i in enumerate(indices) if i is not None]
    idx = [i for i in indices if i is not None]
    if not idx:
        return x
    if any(i.dtype not in ("int32", "int64") for i in idx):
        raise Unsupported("with a boolean index (the result's shape depends on the data)")
    return cx.op("index", x, *idx, dims=dims)


@handles("expand")
def _expand(cx, x, *args, **kw):
    shape, _ = cx.meta()
    return x if shape == x.shape else cx.op("expand", x, shape=list(shape))


def _slice_or_empty(prev):
    """A slice that selects nothing (Phi-3's `q[..., rotary_dim:]` when the rotary covers the
    whole head) as an empty constant, which a concatenation drops; other slices as aten's."""

    def handler(cx, x, dim=0, start=None, end=None, step=1):
        n = x.shape[dim % len(x.shape)]
        lo, hi = slice(start, end).indices(n)[:2]
        if hi <= lo:
            shape, dtype = cx.meta()
            return fold.Const(torch.empty(shape, dtype=getattr(torch, dtype)), cx.stem)
        return prev(cx, x, dim, start, end, step)

    return handler


def _cat_nonempty(prev):
    def handler(cx, xs, dim=0):
        kept = [x for x in xs if not isinstance(x, fold.Const)]  # only empty Consts reach a handler
        if len(kept) == 1:
            return kept[0]
        return prev(cx, kept, dim)

    return handler


ATEN["slice"] = _slice_or_empty(ATEN["slice"])
ATEN["cat"] = ATEN["concat"] = _cat_nonempty(ATEN["cat"])


# ---- elementwise math -------------------------------------------------------------------------------
@handles("rsqrt", "sqrt", "exp", "sin", "cos")
def _math(cx, x):
    _, dt = cx.meta()
    return cx.unary(_packet(cx), _cast(cx, x, dt))


def _arith(prev):
    """Wraps aten's float arithmetic: operands cast to the promoted dtype; an integer or bool
    result gets its Python number as a constant tensor (the scalar ops are for floats)."""

    def handler(cx, a, b, *rest, **kw):
        _, dt = cx.meta()
        if dt in FLOATS and all(v.dtype == dt for v in (a, b) if isinstance(v, Value)):
            return prev(cx, a, b, *rest, **kw)
        if dt in FLOATS:
            a, b = (_cast(cx, v, dt) if isinstance(v, Value) else v for v in (a, b))
        else:
            a, b = _operand(cx, a, dt), _operand(cx, b, dt)
        return prev(cx, a, b, *rest, **kw)

    return handler


for _op in ("add", "sub", "rsub", "mul", "div"):
    ATEN[_op] = _arith(ATEN[_op])


# ---- attention with a mask --------------------------------------------------------------------------
def _sdpa_masked(prev):
    """scaled_dot_product_attention with `attn_mask` (bool, or added to the scores) as `sdpa_mask`;
    without one, aten's handler (`sdpa`, causal or not)."""

    def handler(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is None:
            return prev(cx, q, k, v, None, dropout_p, is_causal, scale, enable_gqa)
        if dropout_p:
            raise Unsupported(f"with dropout_p={dropout_p}")
        if is_causal:
            raise Unsupported("with both attn_mask and is_causal=True (torch refuses it too)")
        if enable_gqa and q.shape[-3] != k.shape[-3]:
            raise Unsupported("with grouped-query heads (enable_gqa)")
        mask = attn_mask if attn_mask.dtype == "bool" else _cast(cx, attn_mask, q.dtype)
        s = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return cx.op("sdpa_mask", q, k, v, mask, scale=s)

    return handler


ATEN["scaled_dot_product_attention"] = _sdpa_masked(ATEN["scaled_dot_product_attention"])
