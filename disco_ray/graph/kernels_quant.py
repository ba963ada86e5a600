"""Group-wise min-max quantization in torch (`quant` says the packed layout): `quantize` (where a
worker reads a weight), `dequantize` and the `dequant` op's kernel (on the device that uses it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .quant import Quant

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]


def quantize(w: torch.Tensor, q: Quant) -> torch.Tensor:
    """The packed uint8 form [out, width] of weight `w` [out, in] (any float dtype)."""
    rows, cols = w.shape
    ng, top = q.groups(cols), (1 << q.bits) - 1
    x = w.float()
    if ng * q.group != cols:  # the last group's missing elements repeat its last: min, max unchanged
        x = torch.cat([x, x[:, -1:].expand(rows, ng * q.group - cols)], dim=1)
    x = x.view(rows, ng, q.group)
    lo, hi = x.amin(dim=2), x.amax(dim=2)
    # scale and zero as stored (float16), so that codes are chosen for the values they decode to
    scale = ((hi - lo) / top).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: codes 0
    zero = lo.half()
    if not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        raise ValueError("values beyond float16's range (65504): a scale or zero point overflows")
    codes = ((x - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, top)
    codes = codes.to(torch.uint8).view(rows, ng * q.group)[:, :cols]
    cb = q.code_bytes(cols)
    out = torch.zeros(rows, cb + 4 * ng, dtype=torch.uint8)
    if q.bits == 8:
        out[:, :cols] = codes
    else:
        pairs = torch.zeros(rows, 2 * cb, dtype=torch.uint8)
        pairs[:, :cols] = codes
        out[:, :cb] = pairs[:, 0::2] | (pairs[:, 1::2] << 4)
    out[:, cb:] = torch.cat([scale, zero], dim=1).view(torch.uint8)
    return out


def dequantize(packed: torch.Tensor, q: Quant, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight [out, cols] in `dtype` from its packed form (`quantize`'s)."""
    out = torch.empty(packed.shape[0], cols, dtype=dtype, device=packed.device)
    _dequant_into(out, packed, q)
    return out


def _dequant_into(out: torch.Tensor, packed: torch.Tensor, q: Quant) -> None:
    rows, cols = out.shape
    ng, cb = q.groups(cols), q.code_bytes(cols)
    sz = packed[:, cb:].view(torch.float16).view(rows, 2, ng).float()
    codes = packed[:, :cb]
    # whole groups into a float32 output: dequantized in place, no temporary
    direct = ng * q.group == cols and out.dtype == torch.float32 and out.is_contiguous()
    full = out if direct else torch.empty(rows, ng * q.group, dtype=torch.float32, device=packed.device)
    if q.bits == 8:
        full[:, :cols] = codes[:, :cols]
    else:  # element 2i in the low nibble, 2i+1 in the high one
        full[:, 0:cols:2] = codes[:, : (cols + 1) // 2] & 15
        full[:, 1:cols:2] = codes[:, : cols // 2] >> 4
    g = full.view(rows, ng, q.group)
    if not direct and ng * q.group != cols:
        full[:, cols:] = 0  # the last group's missing elements: any finite value, dropped below
    g.mul_(sz[:, 0, :, None]).add_(sz[:, 1, :, None])
    if not direct:
        out.copy_(full[:, :cols])


def _dequant(out, ins, attrs):
    _dequant_into(
        out, ins[0][attrs["start"] : attrs["start"] + out.shape[0]], Quant(attrs["bits"], attrs["group"])
    )


def _dequant_temps(out, ins, attrs):
    # the float32 codes (a row rounded up to whole groups), the unpacked nibbles, the scales
    rows, cols = out.shape
    q = Quant(attrs["bits"], attrs["group"])
    return rows * (4 * q.groups(cols) * q.group + 2 * q.code_bytes(cols) + 16 * q.groups(cols))


KERNELS: dict[str, Impl] = {"dequant": _dequant}
TEMPS: dict[str, TempBytes] = {"dequant": _dequant_temps}
