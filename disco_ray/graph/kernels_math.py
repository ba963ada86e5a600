"""Torch implementations of the elementwise math ops (`ops_math`), each writing into a given
output view with torch's out= form. `KERNELS` maps op names to functions `(out, ins, attrs)`,
`TEMPS` to what they allocate besides `out` (none)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]


def _unary(fn) -> Impl:
    def run(out, ins, attrs):
        fn(ins[0], out=out)

    return run


KERNELS: dict[str, Impl] = {
    "rsqrt": _unary(torch.rsqrt),
    "sqrt": _unary(torch.sqrt),
    "exp": _unary(torch.exp),
    "sin": _unary(torch.sin),
    "cos": _unary(torch.cos),
}


def _none(out, ins, attrs) -> int:
    return 0


TEMPS: dict[str, TempBytes] = dict.fromkeys(KERNELS, _none)
