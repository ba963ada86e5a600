"""Torch implementations of the ops of `ops_conv` and `ops_math`, each writing into a given output
view. `KERNELS` maps op names to functions `(out, ins, attrs)`, `TEMPS` to what they allocate
besides `out` (bytes, an upper bound); `kernels` merges both (this module imports nothing of the
project, so no cycle). Each calls the torch function a module's forward calls (F.conv2d,
F.batch_norm, F.max_pool2d, ...), so a graph from `disco_ray.frontend` computes what the module
computes, rounding included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _conv(out, ins, attrs):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) == 3 else None
    k = w.dim() - 2
    fn = CONVS[k]
    out.copy_(fn(x, w, b, attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"]))


def _batchnorm(out, ins, attrs):
    x, mean, var = ins[:3]
    w = ins[3] if len(ins) > 3 else None
    b = ins[4] if len(ins) > 4 else None
    out.copy_(F.batch_norm(x, mean, var, w, b, False, 0.0, attrs["eps"]))


def _group_norm(out, ins, attrs):
    w = ins[1] if len(ins) > 1 else None
    b = ins[2] if len(ins) > 2 else None
    out.copy_(F.group_norm(ins[0], attrs["groups"], w, b, attrs["eps"]))


def _max_pool2d(out, ins, attrs):
    a = attrs
    out.copy_(F.max_pool2d(ins[0], a["kernel"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"]))


def _avg_pool2d(out, ins, attrs):
    a = attrs
    out.copy_(
        F.avg_pool2d(
            ins[0],
            a["kernel"],
            a["stride"],
            a["padding"],
            a["ceil_mode"],
            a["count_include_pad"],
            a["divisor"],
        )
    )


def _adaptive_avg_pool2d(out, ins, attrs):
    out.copy_(F.adaptive_avg_pool2d(ins[0], attrs["size"]))


def _log_softmax(out, ins, attrs):
    torch.log_softmax(ins[0], attrs["axis"], out=out)


def _leaky_relu(out, ins, attrs):
    torch.ops.aten.leaky_relu.out(ins[0], attrs["slope"], out=out)


def _hardswish(out, ins, attrs):
    torch.ops.aten.hardswish.out(ins[0], out=out)


def _pow_scalar(out, ins, attrs):
    e = attrs["exponent"]
    torch.pow(ins[0], int(e) if float(e).is_integer() else e, out=out)  # an integer power as torch's x ** 3


def _scalar_pow(out, ins, attrs):
    torch.pow(attrs["base"], ins[0], out=out)


def _pow(out, ins, attrs):
    torch.pow(ins[0], ins[1], out=out)


def _cumsum(out, ins, attrs):
    torch.cumsum(ins[0], attrs["axis"], out=out)


def _full(out, ins, attrs):
    out.fill_(attrs["value"])


KERNELS: dict[str, Impl] = {
    "conv": _conv,
    "batchnorm": _batchnorm,
    "group_norm": _group_norm,
    "max_pool2d": _max_pool2d,
    "avg_pool2d": _avg_pool2d,
    "adaptive_avg_pool2d": _adaptive_avg_pool2d,
    "log_softmax": _log_softmax,
    "leaky_relu": _leaky_relu,
    "hardswish": _hardswish,
    "pow_scalar": _pow_scalar,
    "scalar_pow": _scalar_pow,
    "pow": _pow,
    "cumsum": _cumsum,
    "full": _full,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _none(out, ins, attrs) -> int:
    return 0


def _result(out, ins, attrs) -> int:
    return _nbytes(out)


def _conv_temps(out, ins, attrs) -> int:
    # the result, plus the unfolded input a GEMM-based algorithm makes ([C/g * kernel] x output
    # positions per image): an upper bound of what the CPU path and cuDNN's GEMM algorithms take
    w = ins[1]
    cols = out.shape[0] * math.prod(w.shape[1:]) * math.prod(out.shape[2:]) * ins[0].element_size()
    return _nbytes(out) + cols


def _norm_temps(out, ins, attrs) -> int:
    return _nbytes(out) + 8 * out.shape[0] * out.shape[1]  # the result and float32 statistics


TEMPS: dict[str, TempBytes] = {
    **dict.fromkeys(("log_softmax", "leaky_relu", "hardswish", "pow_scalar", "scalar_pow", "pow"), _none),
    **dict.fromkeys(("cumsum", "full"), _none),
    **dict.fromkeys(("avg_pool2d", "adaptive_avg_pool2d"), _result),
    "max_pool2d": lambda out, ins, attrs: _nbytes(out) + 8 * out.numel(),  # + the int64 indices on CUDA
    "conv": _conv_temps,
    "batchnorm": _norm_temps,
    "group_norm": _norm_temps,
}
