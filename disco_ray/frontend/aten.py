"""The ATen ops `from_torch` maps onto the op set, one handler each (`ATEN`, by op name; the CNN
ops' are in `aten_cnn`), and the mappings of one's own (`register_aten`, looked up first).

A handler gets the lowering state (`lower.Lowering`: the graph, the node's GPU, `op`, `unary`,
`add`, `linear`, `meta`) and the node's arguments, tensors as `Value`s; it returns a Value, a
tuple of them (split, chunk), or a Python value. A form of an op that has no mapping (dropout in
training, an attention mask) raises `Unsupported`, whose message completes "aten op X ...".
Views (view, reshape, transpose, permute, slice, select, split, ...) cost nothing until an op
reads them (`values.Graph.view`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from .values import Value

Handler = Callable[..., object]
ATEN: dict[str, Handler] = {}  # aten op name (its overload packet: "conv2d") -> handler
OWN: dict[str, Handler] = {}  # what `register_aten` added, by the name it was given


class Unsupported(Exception):
    """This form of a supported op has no mapping; the message completes "aten op X ..."."""


def handles(*names: str):
    def deco(fn: Handler) -> Handler:
        for n in names:
            ATEN[n] = fn
        return fn

    return deco


def _axis(d: int, rank: int) -> int:
    return d % rank if rank else 0


# ---- no copies -------------------------------------------------------------------------------------
@handles("contiguous", "clone", "alias", "detach", "lift_fresh_copy")
def _same(cx, x, *args, **kw):
    return x


@handles("_assert_tensor_metadata")
def _assert(cx, *args, **kw):
    return None


@handles("dropout", "feature_dropout")
def _dropout(cx, x, p, train):
    if train and p > 0:
        raise Unsupported(f"in training mode (p={p}): capture the module in eval mode")
    return x


@handles("getitem")
def _getitem(cx, seq, i):
    return operator.getitem(seq, i)


# ---- views: reshapes, permutes and slices, folded until an op reads them --------------------------
@handles("view", "_unsafe_view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze")
def _reshape(cx, x, *args, **kw):
    shape, _ = cx.meta()
    return cx.g.view(x, "reshape", shape, shape, cx.stem)


@handles("expand")
def _expand(cx, x, *args, **kw):
    shape, _ = cx.meta()
    if shape != x.shape:
        raise Unsupported(f"from {list(x.shape)} to {list(shape)} (only broadcasting ops broadcast)")
    return x


@handles("transpose", "swapaxes")
def _transpose(cx, x, d0, d1):
    dims = list(range(len(x.shape)))
    a, b = _axis(d0, len(dims)), _axis(d1, len(dims))
    dims[a], dims[b] = dims[b], dims[a]
    return cx.g.view(x, "permute", tuple(dims), cx.meta()[0], cx.stem)


@handles("t")
def _t(cx, x):
    return x if len(x.shape) < 2 else _transpose(cx, x, 0, 1)


@handles("permute")
def _permute(cx, x, dims):
    return cx.g.view(x, "permute", tuple(_axis(d, len(x.shape)) for d in dims), cx.meta()[0], cx.stem)


def _slice_view(cx, x: Value, axis: int, start: int, stop: int, stem: str) -> Value:
    shape = tuple(stop - start if d == axis else n for d, n in enumerate(x.shape))
    return cx.g.view(x, "slice", (axis, start, stop), shape, stem)


@handles("slice")
def _slice(cx, x, dim=0, start=None, end=None, step=1):
    if step != 1:
        raise Unsupported(f"with step {step} (only step 1)")
    axis = _axis(dim, len(x.shape))
    n = x.shape[axis]
    lo, hi = slice(start, end).indices(n)[:2]
    if hi <= lo:
        raise Unsupported(f"giving an empty range [{start}, {end}) of {n}")
    return x if (lo, hi) == (0, n) else _slice_view(cx, x, axis, lo, hi, cx.stem)


@handles("select")
def _select(cx, x, dim, index):
    axis = _axis(dim, len(x.shape))
    i = index % x.shape[axis]
    piece = _slice_view(cx, x, axis, i, i + 1, cx.stem)
    shape, _ = cx.meta()
    return cx.g.view(piece, "reshape", shape, shape, cx.stem)


def _pieces(cx, x: Value, sizes: list[int], dim: int) -> tuple[Value, ...]:
    axis, at, out = _axis(dim, len(x.shape)), 0, []
    for k, n in enumerate(sizes):
        out.append(_slice_view(cx, x, axis, at, at + n, f"{cx.stem}.{k}") if n != x.shape[axis] else x)
        at += n
    return tuple(out)


@handles("split")
def _split(cx, x, size, dim=0):
    if isinstance(size, (list, tuple)):
        return _pieces(cx, x, list(size), dim)
    n = x.shape[_axis(dim, len(x.shape))]
    return _pieces(cx, x, [min(size, n - a) for a in range(0, n, size)], dim)


@handles("split_with_sizes")
def _split_with_sizes(cx, x, sizes, dim=0):
    return _pieces(cx, x, list(sizes), dim)


@handles("chunk")
def _chunk(cx, x, chunks, dim=0):
    n = x.shape[_axis(dim, len(x.shape))]
    size = -(-n // chunks)
    return _pieces(cx, x, [min(size, n - a) for a in range(0, n, size)], dim)


@handles("unbind")
def _unbind(cx, x, dim=0):
    axis = _axis(dim, len(x.shape))
    rest = tuple(n for d, n in enumerate(x.shape) if d != axis)
    return tuple(
        cx.g.view(p, "reshape", rest, rest, f"{cx.stem}.{k}")
        for k, p in enumerate(_pieces(cx, x, [1] * x.shape[axis], dim))
    )


# ---- elementwise -----------------------------------------------------------------------------------
@handles("relu", "silu", "tanh", "sigmoid")
def _unary(cx, x):
    assert cx.node is not None
    return cx.unary(cx.node.target.overloadpacket.__name__, x)


@handles("gelu")
def _gelu(cx, x, approximate="none"):
    return cx.unary("gelu", x, approximate=approximate)


@handles("neg")
def _neg(cx, x):
    return cx.unary("scale", x, factor=-1.0)


def _scaled(cx, x: Value, alpha) -> Value:
    return x if alpha == 1 else cx.unary("scale", x, factor=float(alpha))


@handles("add")
def _add(cx, a, b, alpha=1):
    if not isinstance(b, Value):
        return cx.unary("add_scalar", a, value=float(b) * alpha)
    return cx.add(a, _scaled(cx, b, alpha))


@handles("sub")
def _sub(cx, a, b, alpha=1):
    if not isinstance(b, Value):
        return cx.unary("add_scalar", a, value=-float(b) * alpha)
    return cx.op("sub", a, _scaled(cx, b, alpha))


@handles("rsub")
def _rsub(cx, a, b, alpha=1):
    if isinstance(b, Value):
        return cx.op("sub", b, _scaled(cx, a, alpha))
    return cx.unary("add_scalar", _scaled(cx, a, -alpha), value=float(b))


@handles("mul")
def _mul(cx, a, b):
    if not isinstance(b, Value):
        return cx.unary("scale", a, factor=float(b))
    return cx.op("mul", a, b)


@handles("div")
def _div(cx, a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise Unsupported(f"with rounding_mode={rounding_mode!r}")
    if not isinstance(b, Value):
        return cx.unary("scale", a, factor=1.0 / float(b))
    return cx.op("div", a, b)


@handles("_to_copy", "to")
def _to(cx, x, *args, **kw):
    _, dtype = cx.meta()
    return x if dtype == x.dtype else cx.unary("cast", x, dtype=dtype)


# ---- layers ----------------------------------------------------------------------------------------
@handles("linear")
def _linear(cx, x, w, b=None):
    return cx.linear(x, w, b)


@handles("matmul", "mm", "bmm")
def _matmul(cx, a, b):
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise Unsupported(f"of {list(a.shape)} and {list(b.shape)} (operands of rank >= 2 only)")
    return cx.op("matmul", a, b)


@handles("addmm")
def _addmm(cx, bias, a, b, beta=1, alpha=1):
    prod = _scaled(cx, cx.op("matmul", a, b), alpha)
    return cx.add(_scaled(cx, bias, beta), prod)


@handles("layer_norm")
def _layer_norm(cx, x, shape, w=None, b=None, eps=1e-5, cudnn_enable=False):
    if len(shape) != 1:
        raise Unsupported(f"over the last {len(shape)} dims (only over the last one)")
    if w is None and b is not None:
        raise Unsupported("with a bias but no weight")
    return cx.op("layernorm", x, *[v for v in (w, b) if v is not None], eps=float(eps))


@handles("softmax", "_softmax")
def _softmax(cx, x, dim, *rest):
    return cx.op("softmax", x, axis=_axis(dim, len(x.shape)))


@handles("scaled_dot_product_attention")
def _sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise Unsupported("with an attn_mask (is_causal=True is supported)")
    if dropout_p:
        raise Unsupported(f"with dropout_p={dropout_p}")
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        raise Unsupported("with grouped-query heads (enable_gqa)")
    return cx.op("sdpa", q, k, v, causal=bool(is_causal), scale=scale)


@handles("embedding")
def _embedding(cx, w, ids, *rest):
    return cx.op("embedding", ids, w)


@handles("cat", "concat")
def _cat(cx, xs, dim=0):
    return cx.op("concat", *xs, axis=_axis(dim, len(xs[0].shape)))


# ---- reductions ------------------------------------------------------------------------------------
def _reduce(cx, op: str, x, dim, keepdim: bool, dtype) -> Value:
    if dtype is not None:
        raise Unsupported(f"with dtype={dtype}")
    rank = len(x.shape)
    dims = range(rank) if dim is None or dim == [] else [dim] if isinstance(dim, int) else dim
    return cx.op(op, x, axes=sorted({_axis(d, rank) for d in dims}), keepdim=bool(keepdim))


@handles("mean")
def _mean(cx, x, dim=None, keepdim=False, dtype=None):
    return _reduce(cx, "mean", x, dim, keepdim, dtype)


@handles("sum")
def _sum(cx, x, dim=None, keepdim=False, dtype=None):
    return _reduce(cx, "sum", x, dim, keepdim, dtype)


def supported() -> list[str]:
    """The aten op names `from_torch` maps (docs list them)."""
    return sorted(ATEN)


def register_aten(name: str, handler: Handler) -> None:
    """Maps torch op `name` with `handler` in every later `from_torch` of this process.

    Args:
        name: the op as an unsupported-op error names it: one overload ("aten.erf.default",
            "mylib.swish.default", a custom op of torch.library), or the op without namespace and
            overload ("erf": every overload of the aten op). It takes precedence over a built-in
            mapping of the same op.
        handler: `handler(cx, *args, **kwargs)`, called with the node's arguments (tensors as
            Values), returns a Value (or a tuple of them): `cx.op("my_op", x, attr=...)` runs
            the registered op `my_op` on the node's GPU over Values made whole there, and
            `cx.meta()` is the (shape, dtype) torch gives the node's result (docs/FRONTEND.md).

    Raises:
        UsageError: `name` is not a non-empty string or `handler` is not callable.
    """
    from disco_ray.graph.errors import UsageError

    if not isinstance(name, str) or not name.strip():
        raise UsageError(f"register_aten: name must be an op name such as 'aten.erf.default', got {name!r}")
    if not callable(handler):
        raise UsageError(f"register_aten({name!r}): handler must be callable, got {type(handler).__name__}")
    OWN[name.removeprefix("torch.ops.")] = handler


def unregister_aten(name: str) -> None:
    """Takes a mapping `register_aten` added back out (tests, notebooks)."""
    OWN.pop(name.removeprefix("torch.ops."), None)


def lookup(target) -> Handler | None:
    """The handler of an FX node's target: one `register_aten` gave, else the built-in mapping of
    an aten op (or of operator.getitem); None when there is none."""
    packet = getattr(target, "overloadpacket", None)
    name = str(getattr(packet, "__name__", None) or getattr(target, "__name__", str(target)))
    if packet is not None and getattr(target, "namespace", "aten") != "aten":
        return OWN.get(str(target))  # a custom op named like an aten op is not that op
    return OWN.get(str(target)) or OWN.get(name) or ATEN.get(name)
