"""Torch implementations of gradient-norm clipping (`ops_optim`: `sum_squares`, `clip_coef`,
`scale_grad`); AdamW and SGD are in `kernels_train`. No host syncs: the norm and the scale stay
on the device."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]


def _sum_squares(out, ins, attrs):
    out.copy_(ins[0].float().square().sum().reshape(1))


def _clip_coef(out, ins, attrs):
    # clip_grad_norm_: the norm of all gradients as one vector; coef = max_norm / (norm + 1e-6), at most 1
    norm = torch.stack([x.reshape(()) for x in ins]).sum().sqrt()
    out[0] = norm
    out[1] = torch.clamp(attrs["max_norm"] / (norm + 1e-6), max=1.0)


def _scale_grad(out, ins, attrs):
    grad, clip = ins
    torch.mul(grad, clip[1].to(grad.dtype), out=out)


KERNELS: dict[str, Impl] = {
    "sum_squares": _sum_squares,
    "clip_coef": _clip_coef,
    "scale_grad": _scale_grad,
}
