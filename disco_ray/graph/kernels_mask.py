"""Torch implementations of the mask and position ops (`ops_mask`), each writing into a given
output view with the torch function a model's forward calls. `KERNELS` maps op names to
functions `(out, ins, attrs)`, `TEMPS` to what they allocate besides `out` (bytes, an upper
bound); `kernels` merges both (this module imports nothing of the project, so no cycle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]


def _binary(fn) -> Impl:
    def run(out, ins, attrs):
        fn(ins[0], ins[1], out=out)

    return run


def _logical_not(out, ins, attrs):
    torch.logical_not(ins[0], out=out)


def _where(out, ins, attrs):
    torch.where(ins[0], ins[1], ins[2], out=out)


def _index(out, ins, attrs):
    x = ins[0]
    at = [slice(None)] * x.dim()
    for d, i in zip(attrs["dims"], ins[1:]):
        at[d] = i
    out.copy_(x[tuple(at)])


def _expand(out, ins, attrs):
    out.copy_(ins[0].expand(out.shape))


def _sdpa_mask(out, ins, attrs):
    q, k, v, m = ins
    out.copy_(F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=attrs["scale"]))


KERNELS: dict[str, Impl] = {
    "eq": _binary(torch.eq),
    "ne": _binary(torch.ne),
    "lt": _binary(torch.lt),
    "le": _binary(torch.le),
    "gt": _binary(torch.gt),
    "ge": _binary(torch.ge),
    "logical_and": _binary(torch.logical_and),
    "logical_or": _binary(torch.logical_or),
    "logical_xor": _binary(torch.logical_xor),
    "logical_not": _logical_not,
    "where": _where,
    "index": _index,
    "expand": _expand,
    "sdpa_mask": _sdpa_mask,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _none(out, ins, attrs) -> int:
    return 0


def _sdpa_mask_temps(out, ins, attrs) -> int:
    q, k = ins[0], ins[1]
    scores = (
        q.numel() // q.shape[-1] * k.shape[-2]
    )  # [.., tq, tk]: scores, probabilities, the mask made additive
    return _nbytes(out) + 3 * scores * max(q.element_size(), 4)


TEMPS: dict[str, TempBytes] = {
    **dict.fromkeys(("eq", "ne", "lt", "le", "gt", "ge", "logical_not", "where", "expand"), _none),
    **dict.fromkeys(("logical_and", "logical_or", "logical_xor"), _none),
    "index": lambda out, ins, attrs: _nbytes(out),  # x[...] makes the result, then it is copied
    "sdpa_mask": _sdpa_mask_temps,
}
