"""The ATen ops of convolutional networks and the math around them, mapped onto `ops_conv` and
`ops_math` (registered into `aten.ATEN` by name, as `aten`'s own handlers).

Under `split="tensor"` on several GPUs a convolution whose weight is a parameter (groups 1, at
least one output channel per GPU) is split by output channels, as a column-parallel linear layer
by output features: each GPU gets the whole input and its rows of the weight and bias, and holds
its channels of the output. The ops that treat channels independently (batch norm, pooling, the
activations, adds of two alike splits) then run on the parts where they lie; anything else, and
the next convolution, gathers the channels by transfers and one concat. The weights of the
convolutions, most of a CNN's bytes, are so spread evenly over the GPUs.

An in-place op (`relu_`, `add_`, ...) is mapped as its out-of-place form when it is the only
reader of the tensor it updates, which is no view (the usual `out += identity; relu(out)`), and
refused otherwise.
"""

from __future__ import annotations

import torch

from .aten import ATEN, Unsupported, _axis, handles
from .values import Part, Value

CHANNEL = 1  # the channel axis of [N, C, ...]


def _tiles(n: int, k: int) -> list[tuple[int, int]]:
    b = [round(j * n / k) for j in range(k + 1)]
    return [(b[j], b[j + 1]) for j in range(k)]


def _as_list(x, n: int) -> list[int]:
    """An int-or-list argument of aten (`stride=2`, `[2]`, `[2, 1]`) as n ints."""
    vals = list(x) if isinstance(x, (list, tuple)) else [x]
    return [int(v) for v in (vals * n if len(vals) == 1 else vals)]


# ---- convolution -----------------------------------------------------------------------------------
def _padding(pad, w: Value, dilation: list[int], k: int) -> list[int]:
    if pad == "valid":
        return [0] * k
    if pad == "same":
        total = [dilation[d] * (w.shape[2 + d] - 1) for d in range(k)]
        if any(t % 2 for t in total):
            raise Unsupported("with padding='same' and an even (dilated) kernel (asymmetric padding)")
        return [t // 2 for t in total]
    return _as_list(pad, k)


@handles("conv1d", "conv2d", "conv3d")
def _conv(cx, x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    k = len(w.shape) - 2
    if len(x.shape) != k + 2:
        raise Unsupported(f"of an unbatched input {list(x.shape)} (only [N, C, *spatial])")
    dil = _as_list(dilation, k)
    attrs = dict(
        stride=_as_list(stride, k), padding=_padding(padding, w, dil, k), dilation=dil, groups=int(groups)
    )
    split = cx.split == "tensor" and cx.gpus > 1 and w.weight is not None and groups == 1
    if split and w.shape[0] >= cx.gpus and (b is None or b.weight is not None):
        return _conv_by_channels(cx, x, w, b, attrs)
    return cx.op("conv", x, w, *([b] if b is not None else []), **attrs)


@handles("convolution", "_convolution")
def _convolution(cx, x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    if transposed:
        raise Unsupported("transposed (a ConvTranspose layer)")
    return _conv(cx, x, w, b, stride, padding, dilation, groups)


def _conv_by_channels(cx, x: Value, w: Value, b: Value | None, attrs: dict) -> Value:
    """Column-parallel: GPU j convolves the whole input with its rows of the weight (module doc)."""
    assert w.weight is not None
    g = cx.g
    shape, dtype = cx.meta()
    parts = []
    for j, (lo, hi) in enumerate(_tiles(w.shape[0], cx.gpus)):
        ins = [g.on(x, j), g.weights.input(g.tg, w.weight, j, g.fresh, rows=(lo, hi))]
        if b is not None:
            assert b.weight is not None
            ins.append(g.weights.input(g.tg, b.weight, j, g.fresh, rows=(lo, hi)))
        parts.append(Part(j, g.kernel("conv", *ins, gpu=j, stem=f"{cx.stem}@g{j}", **attrs), lo, hi))
    return Value(shape, dtype, cx.stem, parts=tuple(parts), axis=CHANNEL)


def _by_channel(x: Value) -> bool:
    return x.split and x.axis % len(x.shape) == CHANNEL


def _channelwise(cx, op: str, x: Value, **attrs) -> Value:
    """An op that treats channels independently: on each part of a split by channels."""
    return cx.unary(op, x, **attrs) if _by_channel(x) else cx.op(op, x, **attrs)


# ---- normalization ---------------------------------------------------------------------------------
def _batchnorm(cx, x: Value, w, b, mean, var, eps) -> Value:
    if mean is None or var is None:
        raise Unsupported("without running statistics (track_running_stats=False normalizes by the batch)")
    if w is None and b is not None:
        raise Unsupported("with a bias but no weight")
    per_channel = [v for v in (mean, var, w, b) if v is not None]
    if not (_by_channel(x) and all(v.weight is not None for v in per_channel)):
        return cx.op("batchnorm", x, *per_channel, eps=float(eps))
    g = cx.g
    shape, dtype = cx.meta()
    parts = []
    for p in x.parts:  # each GPU normalizes its channels with its entries of the statistics
        ins = [
            p.id,
            *(g.weights.input(g.tg, v.weight, p.gpu, g.fresh, rows=(p.lo, p.hi)) for v in per_channel),
        ]
        parts.append(
            Part(
                p.gpu,
                g.kernel("batchnorm", *ins, gpu=p.gpu, stem=f"{cx.stem}@g{p.gpu}", eps=float(eps)),
                p.lo,
                p.hi,
            )
        )
    return Value(shape, dtype, cx.stem, parts=tuple(parts), axis=CHANNEL)


@handles("batch_norm")
def _batch_norm(cx, x, w, b, mean, var, training, momentum, eps, *rest):
    if training:
        raise Unsupported("in training mode: capture the module in eval mode (running statistics)")
    return _batchnorm(cx, x, w, b, mean, var, eps)


@handles("_native_batch_norm_legit_no_training")
def _bn_no_training(cx, x, w, b, mean, var, momentum, eps):
    return (_batchnorm(cx, x, w, b, mean, var, eps), None, None)  # the saved statistics: none in eval


@handles("group_norm")
def _group_norm(cx, x, groups, w=None, b=None, eps=1e-5, *rest):
    if w is None and b is not None:
        raise Unsupported("with a bias but no weight")
    return cx.op("group_norm", x, *[v for v in (w, b) if v is not None], groups=int(groups), eps=float(eps))


@handles("rms_norm")
def _rms_norm(cx, x, shape, w=None, eps=None):
    if len(shape) != 1:
        raise Unsupported(f"over the last {len(shape)} dims (only over the last one)")
    eps = torch.finfo(getattr(torch, x.dtype)).eps if eps is None else eps  # torch's default
    return cx.op("rmsnorm", x, *([w] if w is not None else []), eps=float(eps))


# ---- pooling ---------------------------------------------------------------------------------------
@handles("max_pool2d")
def _max_pool2d(cx, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    if len(x.shape) != 4:
        raise Unsupported(f"of an unbatched input {list(x.shape)} (only [N, C, H, W])")
    k = _as_list(kernel, 2)
    attrs = dict(kernel=k, stride=_as_list(stride, 2) if stride else k, padding=_as_list(padding, 2))
    return _channelwise(
        cx, "max_pool2d", x, **attrs, dilation=_as_list(dilation, 2), ceil_mode=bool(ceil_mode)
    )


@handles("avg_pool2d")
def _avg_pool2d(cx, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor=None):
    if len(x.shape) != 4:
        raise Unsupported(f"of an unbatched input {list(x.shape)} (only [N, C, H, W])")
    k = _as_list(kernel, 2)
    attrs = dict(kernel=k, stride=_as_list(stride, 2) if stride else k, padding=_as_list(padding, 2))
    extra = dict(ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad), divisor=divisor)
    return _channelwise(cx, "avg_pool2d", x, **attrs, **extra)


@handles("adaptive_avg_pool2d", "_adaptive_avg_pool2d")
def _adaptive_avg_pool2d(cx, x, size):
    if len(x.shape) != 4:
        raise Unsupported(f"of an unbatched input {list(x.shape)} (only [N, C, H, W])")
    shape, _ = cx.meta()
    return _channelwise(cx, "adaptive_avg_pool2d", x, size=list(shape[2:]))  # None in size: the input's


# ---- elementwise and scans -------------------------------------------------------------------------
def _like(cx, x: Value) -> Value:
    """x in the dtype torch gives the node's result (type promotion: int ** float, int cumsum)."""
    _, dtype = cx.meta()
    return x if x.dtype == dtype else cx.unary("cast", x, dtype=dtype)


@handles("log_softmax", "_log_softmax")
def _log_softmax(cx, x, dim, *rest):
    return cx.op("log_softmax", _like(cx, x), axis=_axis(dim, len(x.shape)))


@handles("leaky_relu")
def _leaky_relu(cx, x, slope=0.01):
    return cx.unary("leaky_relu", x, slope=float(slope))


@handles("hardswish")
def _hardswish(cx, x):
    return cx.unary("hardswish", x)


@handles("pow")
def _pow(cx, x, exponent):
    if not isinstance(x, Value):  # aten.pow.Scalar: a number to a tensor's powers
        return cx.unary("scalar_pow", _like(cx, exponent), base=float(x))
    if isinstance(exponent, Value):
        return cx.op("pow", _like(cx, x), _like(cx, exponent))
    return cx.unary("pow_scalar", _like(cx, x), exponent=float(exponent))


@handles("cumsum")
def _cumsum(cx, x, dim, dtype=None):
    return cx.op("cumsum", _like(cx, x), axis=_axis(dim, len(x.shape)))


# ---- in place --------------------------------------------------------------------------------------
ALIASING = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "flatten",
        "unflatten",
        "unsqueeze",
        "squeeze",
        "expand",
        "transpose",
        "swapaxes",
        "t",
        "permute",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "alias",
        "detach",
        "contiguous",
        "getitem",
    ]
)


def _in_place(cx) -> None:
    """Refuses an in-place op unless it is the only reader of the tensor it updates and that tensor
    is no view of another nor an input (torch.export already routes later reads through the
    op's result; a view's base, or another reader, would see the update in eager torch only)."""
    node = cx.node
    src = node.args[0]
    if not isinstance(src, torch.fx.Node):
        return
    target = getattr(
        getattr(src.target, "overloadpacket", None), "__name__", getattr(src.target, "__name__", "")
    )
    if src.op != "call_function" or target in ALIASING:
        raise Unsupported(
            f"on {src.name!r}, a view or an input (the update would reach the tensor it aliases)"
        )
    if len(src.users) > 1:
        others = sorted(u.name for u in src.users if u is not node)
        raise Unsupported(
            f"on {src.name!r}, which {', '.join(others)} read too (they would see the old values)"
        )


def _in_place_of(name: str):
    def handler(cx, *args, **kw):
        _in_place(cx)
        return ATEN[name](cx, *args, **kw)

    return handler


@handles("relu_")
def _relu_(cx, x):
    _in_place(cx)
    return cx.unary("relu", x)


for _name in ("add", "sub", "mul", "div", "leaky_relu", "hardswish"):
    ATEN[f"{_name}_"] = _in_place_of(_name)
