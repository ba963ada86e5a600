"""Torch implementations of the general ops (`ops_nn`), each writing into a given output view.

`KERNELS` maps op names to functions `(out, ins, attrs)` and `TEMPS` to what they allocate
besides `out` (bytes, an upper bound); `kernels` merges both (this module imports nothing of the
project, so no cycle). Each calls the torch function a module's forward calls (F.layer_norm,
F.gelu, F.scaled_dot_product_attention), so a graph from `disco_ray.frontend` computes what the
module computes, rounding included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]


def _relu(out, ins, attrs):
    torch.clamp_min(ins[0], 0, out=out)


def _gelu(out, ins, attrs):
    torch.ops.aten.gelu.out(ins[0], approximate=attrs["approximate"], out=out)


def _tanh(out, ins, attrs):
    torch.tanh(ins[0], out=out)


def _sigmoid(out, ins, attrs):
    torch.sigmoid(ins[0], out=out)


def _add_scalar(out, ins, attrs):
    torch.add(ins[0], attrs["value"], out=out)


def _sub(out, ins, attrs):
    torch.sub(ins[0], ins[1], out=out)


def _div(out, ins, attrs):
    torch.div(ins[0], ins[1], out=out)


def _layernorm(out, ins, attrs):
    x = ins[0]
    w = ins[1] if len(ins) > 1 else None
    b = ins[2] if len(ins) > 2 else None
    out.copy_(F.layer_norm(x, x.shape[-1:], w, b, attrs["eps"]))


def _reshape(out, ins, attrs):
    out.copy_(ins[0].reshape(out.shape))


def _permute(out, ins, attrs):
    out.copy_(ins[0].permute(*attrs["dims"]))


def _sum(out, ins, attrs):
    torch.sum(ins[0], dim=list(attrs["axes"]), keepdim=attrs["keepdim"], out=out)


def _mean(out, ins, attrs):
    torch.mean(ins[0], dim=list(attrs["axes"]), keepdim=attrs["keepdim"], out=out)


def _sdpa(out, ins, attrs):
    q, k, v = ins
    out.copy_(F.scaled_dot_product_attention(q, k, v, is_causal=attrs["causal"], scale=attrs["scale"]))


def _cast(out, ins, attrs):
    out.copy_(ins[0])


KERNELS: dict[str, Impl] = {
    "relu": _relu,
    "gelu": _gelu,
    "tanh": _tanh,
    "sigmoid": _sigmoid,
    "add_scalar": _add_scalar,
    "sub": _sub,
    "div": _div,
    "layernorm": _layernorm,
    "reshape": _reshape,
    "permute": _permute,
    "sum": _sum,
    "mean": _mean,
    "sdpa": _sdpa,
    "cast": _cast,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _none(out, ins, attrs) -> int:
    return 0


def _sdpa_temps(out, ins, attrs) -> int:
    q, k = ins[0], ins[1]
    scores = q.numel() // q.shape[-1] * k.shape[-2]  # [.., tq, tk]: the math path's scores and probabilities
    return _nbytes(out) + 2 * scores * max(q.element_size(), 4) + scores  # + a boolean causal mask


TEMPS: dict[str, TempBytes] = {
    **dict.fromkeys(
        (
            "relu",
            "gelu",
            "tanh",
            "sigmoid",
            "add_scalar",
            "sub",
            "div",
            "reshape",
            "permute",
            "cast",
            "sum",
            "mean",
        ),
        _none,
    ),
    # F.layer_norm's result plus its per-row float32 mean and inverse deviation
    "layernorm": lambda out, ins, attrs: _nbytes(out) + 8 * (out.numel() // max(out.shape[-1], 1)),
    "sdpa": _sdpa_temps,
}
