"""Torch implementations of the per-head RMSNorm ops (`ops_headnorm`), each writing into a given
output view; low-precision inputs are normalized in float32, as transformers' RMSNorm does."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]


def _head_rmsnorm(out, ins, attrs):
    x, w = ins
    d = w.shape[0]
    out.unflatten(-1, (-1, d)).copy_(F.rms_norm(x.unflatten(-1, (-1, d)), (d,), w, attrs["eps"]))


def _head_rmsnorm_grad(out, ins, attrs):
    # rmsnorm_grad per head: dx = r * g - r^3 * x * mean(g * x) over each head's d columns, g = dy * w
    x, w, dy = ins
    d = w.shape[0]
    xh, g = x.float().unflatten(-1, (-1, d)), dy.float().unflatten(-1, (-1, d)) * w.float()
    r = torch.rsqrt(xh.square().mean(-1, keepdim=True) + attrs["eps"])
    out.unflatten(-1, (-1, d)).copy_(r * (g - xh * r.square() * (g * xh).mean(-1, keepdim=True)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


KERNELS: dict[str, Impl] = {"head_rmsnorm": _head_rmsnorm, "head_rmsnorm_grad": _head_rmsnorm_grad}
TEMPS: dict[str, Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]] = {
    # F.rms_norm's result and its unfused float32 steps (as rmsnorm's)
    "head_rmsnorm": lambda out, ins, attrs: _nbytes(out) + 3 * ins[0].numel() * 4,
    # float32 copies of x, dy * w, r and the products
    "head_rmsnorm_grad": lambda out, ins, attrs: 5 * ins[0].numel() * 4,
}
