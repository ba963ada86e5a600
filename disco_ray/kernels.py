"""Torch implementations of the op set, each writing its result into a given output view.

The same code runs on CPU tensors and on CUDA views of a GPU arena. An implementation may use
temporaries (torch's allocator), but never resizes or reallocates `out`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from . import ops

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
IMPLS: dict[str, Impl] = {}


def impl(name: str):
    def deco(fn: Impl) -> Impl:
        IMPLS[name] = fn
        return fn

    return deco


def run_kernel(op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    """Runs `op` on `ins`, writing into `out` (shape and dtype as the op infers)."""
    IMPLS[op](out, ins, ops.OPS[op].full_attrs(attrs))


@impl("matmul")
def _matmul(out, ins, attrs):
    torch.matmul(ins[0], ins[1], out=out)


@impl("add")
def _add(out, ins, attrs):
    if len(ins) == 1:
        out.copy_(ins[0])
        return
    torch.add(ins[0], ins[1], out=out)
    for x in ins[2:]:
        out.add_(x)


@impl("mul")
def _mul(out, ins, attrs):
    torch.mul(ins[0], ins[1], out=out)


@impl("scale")
def _scale(out, ins, attrs):
    torch.mul(ins[0], attrs["factor"], out=out)


@impl("softmax")
def _softmax(out, ins, attrs):
    torch.ops.aten._softmax.out(ins[0], -1, False, out=out)


@impl("silu")
def _silu(out, ins, attrs):
    torch.ops.aten.silu.out(ins[0], out=out)


@impl("rmsnorm")
def _rmsnorm(out, ins, attrs):
    x = ins[0]
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + attrs["eps"])
    if len(ins) == 2:
        out.copy_((xf * r).to(x.dtype) * ins[1])
    else:
        out.copy_(xf * r)


@impl("transpose")
def _transpose(out, ins, attrs):
    out.copy_(ins[0].transpose(-1, -2))
