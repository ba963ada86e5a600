"""The convolutional-network ops (`disco_ray.frontend` maps a CNN's aten ops onto them):
convolution over 1 to 3 spatial dims with stride, padding, dilation and groups, batch norm in
eval mode (running statistics), max, average and adaptive average pooling over 2 dims, and
group norm. Pure: arity, attributes, shape/dtype inference, FLOPs; kernels live in
`kernels_conv`.

Tensors are channels-first, [N, C, *spatial], as torch's. Every op here but `conv` treats the
channels independently (group_norm: its groups), so a tensor cut along the channel axis can be
processed part by part; `conv` splits over its output channels (each part needs all the input).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .opspec import OpSpec, Shape, _is_int, _same_dtype, elementwise, numel, register


def ints(name: str, attrs: Mapping, key: str, n: int, least: int) -> tuple[int, ...]:
    """Attribute `key` as n integers >= least (one integer stands for n equal ones)."""
    x = attrs[key]
    vals = [x] * n if _is_int(x) else list(x) if isinstance(x, (list, tuple)) else None
    if vals is not None and len(vals) == 1:
        vals = vals * n
    if vals is None or len(vals) != n or not all(_is_int(v) and v >= least for v in vals):
        raise ValueError(f"{name}: attribute {key} must be {n} integer(s) >= {least}, got {x!r}")
    return tuple(int(v) for v in vals)


def window_out(size: int, k: int, stride: int, pad: int, dilation: int = 1, ceil_mode: bool = False) -> int:
    """Output length of a sliding window over `size` (torch's pooling_output_shape)."""
    span = size + 2 * pad - dilation * (k - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:  # the last window must start inside
        out -= 1
    return out


def _channels_first(name: str, x: Shape, spatial: int) -> None:
    if len(x) != 2 + spatial:
        raise ValueError(
            f"{name} needs x [N, C, {', '.join('*' * spatial)}] of rank {2 + spatial}, got {list(x)}"
        )


def _infer_conv(shapes, dtypes, attrs):
    x, w = shapes[0], shapes[1]
    k = len(w) - 2
    if not 1 <= k <= 3:
        raise ValueError(
            f"conv weight must be [out, in/groups, *kernel] with 1 to 3 kernel dims, got {list(w)}"
        )
    _channels_first("conv", x, k)
    groups = attrs["groups"]
    if not _is_int(groups) or groups < 1:
        raise ValueError(f"conv: attribute groups must be an integer >= 1, got {groups!r}")
    if x[1] != w[1] * groups or w[0] % groups:
        raise ValueError(
            f"conv: x has {x[1]} channels, weight {list(w)} with groups={groups} wants {w[1] * groups} "
            f"(and out channels divisible by groups)"
        )
    if len(shapes) == 3 and shapes[2] != (w[0],):
        raise ValueError(f"conv: bias must have shape [{w[0]}], got {list(shapes[2])}")
    stride = ints("conv", attrs, "stride", k, 1)
    pad = ints("conv", attrs, "padding", k, 0)
    dil = ints("conv", attrs, "dilation", k, 1)
    out = tuple(window_out(x[2 + d], w[2 + d], stride[d], pad[d], dil[d]) for d in range(k))
    if min(out) < 1:
        raise ValueError(f"conv: input {list(x)} is smaller than the (dilated) kernel {list(w[2:])}")
    return (x[0], w[0], *out), _same_dtype("conv", dtypes)


def _flops_conv(shapes, out, attrs):
    w = shapes[1]
    return 2.0 * numel(out) * numel(w[1:])  # a multiply-add per weight of one output channel


def _per_channel(name: str, shapes: Sequence[Shape], first: int, what: str) -> None:
    x = shapes[0]
    if len(x) < 2:
        raise ValueError(f"{name} needs x [N, C, ...], got {list(x)}")
    for s in shapes[first:]:
        if s != (x[1],):
            raise ValueError(f"{name}: {what} must have shape [{x[1]}] (the channels), got {list(s)}")


def _infer_batchnorm(shapes, dtypes, attrs):
    _per_channel("batchnorm", shapes, 1, "running mean, variance, weight and bias")
    return shapes[0], _same_dtype("batchnorm", dtypes)


def _infer_group_norm(shapes, dtypes, attrs):
    _per_channel("group_norm", shapes, 1, "weight and bias")
    g = attrs["groups"]
    if not _is_int(g) or g < 1 or shapes[0][1] % g:
        raise ValueError(f"group_norm: groups must divide the {shapes[0][1]} channels, got {g!r}")
    return shapes[0], _same_dtype("group_norm", dtypes)


def _infer_max_pool(shapes, dtypes, attrs):
    (x,) = shapes
    _channels_first("max_pool2d", x, 2)
    k = ints("max_pool2d", attrs, "kernel", 2, 1)
    s = ints("max_pool2d", attrs, "stride", 2, 1)
    p = ints("max_pool2d", attrs, "padding", 2, 0)
    d = ints("max_pool2d", attrs, "dilation", 2, 1)
    if any(2 * p[i] > k[i] for i in range(2)):
        raise ValueError(f"max_pool2d: padding {list(p)} must be at most half the kernel {list(k)}")
    out = tuple(window_out(x[2 + i], k[i], s[i], p[i], d[i], bool(attrs["ceil_mode"])) for i in range(2))
    if min(out) < 1:
        raise ValueError(f"max_pool2d: input {list(x)} is smaller than the kernel {list(k)}")
    return (*x[:2], *out), _same_dtype("max_pool2d", dtypes)


def _infer_avg_pool(shapes, dtypes, attrs):
    (x,) = shapes
    _channels_first("avg_pool2d", x, 2)
    k = ints("avg_pool2d", attrs, "kernel", 2, 1)
    s = ints("avg_pool2d", attrs, "stride", 2, 1)
    p = ints("avg_pool2d", attrs, "padding", 2, 0)
    div = attrs["divisor"]
    if div is not None and (not _is_int(div) or div < 1):
        raise ValueError(f"avg_pool2d: divisor must be null or an integer >= 1, got {div!r}")
    if any(2 * p[i] > k[i] for i in range(2)):
        raise ValueError(f"avg_pool2d: padding {list(p)} must be at most half the kernel {list(k)}")
    out = tuple(window_out(x[2 + i], k[i], s[i], p[i], 1, bool(attrs["ceil_mode"])) for i in range(2))
    if min(out) < 1:
        raise ValueError(f"avg_pool2d: input {list(x)} is smaller than the kernel {list(k)}")
    return (*x[:2], *out), _same_dtype("avg_pool2d", dtypes)


def _infer_adaptive(shapes, dtypes, attrs):
    (x,) = shapes
    _channels_first("adaptive_avg_pool2d", x, 2)
    out = ints("adaptive_avg_pool2d", attrs, "size", 2, 1)
    return (*x[:2], *out), _same_dtype("adaptive_avg_pool2d", dtypes)


def _flops_window(shapes, out, attrs):
    return float(numel(out) * numel(ints("pool", attrs, "kernel", 2, 1)))


def _flops_adaptive(shapes, out, attrs):
    return float(numel(shapes[0]))  # every input element is read into one or a few windows


register(
    OpSpec(
        "conv",
        2,
        3,
        _infer_conv,
        attrs={"stride": [1], "padding": [0], "dilation": [1], "groups": 1},
        flops=_flops_conv,
        doc="convolution of x [N, C, *spatial] by w [O, C/groups, *kernel] (1 to 3 spatial dims) "
        "[+ b [O]], with stride, zero padding and dilation per spatial dim (one number: the same for "
        "each) and groups (torch's F.conv1d/conv2d/conv3d)",
    )
)
register(
    OpSpec(
        "batchnorm",
        3,
        5,
        _infer_batchnorm,
        attrs={"eps": 1e-5},
        flops=elementwise(4),
        doc="batch norm in eval mode: (x - mean) / sqrt(var + eps) [* w [+ b]] per channel of x "
        "[N, C, ...], operands x, running mean [C], running variance [C], weight [C], bias [C]",
    )
)
register(
    OpSpec(
        "group_norm",
        1,
        3,
        _infer_group_norm,
        attrs={"groups": 1, "eps": 1e-5},
        flops=elementwise(8),
        doc="x [N, C, ...] normalized over each group of C/groups channels (and all spatial "
        "positions) [* w [C] [+ b [C]]] (torch's F.group_norm)",
    )
)
register(
    OpSpec(
        "max_pool2d",
        1,
        1,
        _infer_max_pool,
        attrs={"kernel": [1], "stride": [1], "padding": [0], "dilation": [1], "ceil_mode": False},
        flops=_flops_window,
        doc="the maximum over each kernel window of x [N, C, H, W] (padding counts as -inf; "
        "ceil_mode: a last partial window)",
    )
)
register(
    OpSpec(
        "avg_pool2d",
        1,
        1,
        _infer_avg_pool,
        attrs={
            "kernel": [1],
            "stride": [1],
            "padding": [0],
            "ceil_mode": False,
            "count_include_pad": True,
            "divisor": None,
        },
        flops=_flops_window,
        doc="the mean over each kernel window of x [N, C, H, W] (count_include_pad: padding counts "
        "in the divisor; divisor: a fixed divisor instead)",
    )
)
register(
    OpSpec(
        "adaptive_avg_pool2d",
        1,
        1,
        _infer_adaptive,
        attrs={"size": [1, 1]},
        flops=_flops_adaptive,
        doc="x [N, C, H, W] averaged into size [h, w] windows as torch's F.adaptive_avg_pool2d cuts them",
    )
)

__all__ = ["ints", "window_out"]
