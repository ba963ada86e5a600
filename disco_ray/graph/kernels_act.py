"""Torch implementations of the ops of `ops_act` (GELU's tanh approximation, soft-capping and
their backward), each writing into a given output view. `KERNELS` maps op names to functions
`(out, ins, attrs)`, `TEMPS` to what they allocate besides `out` (bytes, an upper bound);
`kernels` merges both (this module imports nothing of the project, so no cycle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]


def _gelu_tanh(out, ins, attrs):
    torch.ops.aten.gelu.out(ins[0], approximate="tanh", out=out)


def _gelu_tanh_grad(out, ins, attrs):
    # aten's own backward, as autograd runs it for F.gelu(a, approximate="tanh")
    a, dh = ins
    torch.ops.aten.gelu_backward.grad_input(dh, a, approximate="tanh", grad_input=out)


def _softcap(out, ins, attrs):
    # the order transformers' Gemma 2 computes it in: x / cap, tanh, * cap
    cap = attrs["cap"]
    torch.div(ins[0], cap, out=out)
    out.tanh_().mul_(cap)


def _softcap_grad(out, ins, attrs):
    # y = cap * tanh(x / cap)  =>  dx = dy * (1 - tanh^2) with tanh = y / cap
    y, dy = ins
    cap = attrs["cap"]
    torch.div(y, cap, out=out)
    out.square_().neg_().add_(1.0).mul_(dy)


KERNELS: dict[str, Impl] = {
    "gelu_tanh": _gelu_tanh,
    "gelu_tanh_grad": _gelu_tanh_grad,
    "softcap": _softcap,
    "softcap_grad": _softcap_grad,
}


def _none(out, ins, attrs) -> int:
    return 0


TEMPS: dict[str, TempBytes] = dict.fromkeys(KERNELS, _none)
