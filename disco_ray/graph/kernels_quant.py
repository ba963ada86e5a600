"""Group-wise min-max quantization in torch (`quant` says the packed layout): `quantize` (where a
worker reads a weight) and the `quant` op's kernel (a KV cache row as it is written),
`dequantize` and the `dequant` op's kernel (on the device that uses it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .quant import Quant

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]


def quantize(w: torch.Tensor, q: Quant) -> torch.Tensor:
    """The packed uint8 form [out, width] of weight `w` [out, in] (any float dtype)."""
    out = torch.empty(q.packed_shape(tuple(w.shape)), dtype=torch.uint8, device=w.device)
    if not _quant_into(out, w, q):
        raise ValueError("values beyond float16's range (65504): a scale or zero point overflows")
    return out


def _quant_into(out: torch.Tensor, w: torch.Tensor, q: Quant, check: bool = True) -> bool:
    """Packs `w` [rows, cols] into `out` [rows, width] (uint8); with `check`, False when a scale or
    zero point overflows float16 (a host sync: a kernel skips it, the logits' check sees the NaN)."""
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
    if check and not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        return False
    codes = ((x - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, top)
    codes = codes.to(torch.uint8).view(rows, ng * q.group)[:, :cols]
    cb = q.code_bytes(cols)
    if q.bits == 8:
        out[:, :cols] = codes
        out[:, cols:cb] = 0
    else:
        pairs = torch.zeros(rows, 2 * cb, dtype=torch.uint8, device=w.device)
        pairs[:, :cols] = codes
        out[:, :cb] = pairs[:, 0::2] | (pairs[:, 1::2] << 4)
    out[:, cb:] = torch.cat([scale, zero], dim=1).view(torch.uint8)
    return True


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


def _quant(out, ins, attrs):
    _quant_into(out, ins[0], Quant(attrs["bits"], attrs["group"]), check=False)


def dequant_tile(out: torch.Tensor, packed: torch.Tensor, bits: int, group: int) -> None:
    """`packed` rows (`quant`'s layout) dequantized into `out` [rows, cols]: a KV cache tile
    read by attention (`attention_span` with kv_bits)."""
    _dequant_into(out, packed, Quant(bits, group))


def _quant_temps(out, ins, attrs):
    # float32 copies rounded up to whole groups (the input, its padding, (x - zero) / scale), the
    # codes, the nibble pairs; min, max, scale and zero per group
    rows, cols = ins[0].shape
    q = Quant(attrs["bits"], attrs["group"])
    full = q.groups(cols) * q.group
    return rows * (17 * full + 2 * q.code_bytes(cols) + 24 * q.groups(cols))


def _dequant_temps(out, ins, attrs):
    # the float32 codes (a row rounded up to whole groups), the unpacked nibbles, the scales
    rows, cols = out.shape
    q = Quant(attrs["bits"], attrs["group"])
    return rows * (4 * q.groups(cols) * q.group + 2 * q.code_bytes(cols) + 16 * q.groups(cols))


KERNELS: dict[str, Impl] = {"dequant": _dequant, "quant": _quant}
TEMPS: dict[str, TempBytes] = {"dequant": _dequant_temps, "quant": _quant_temps}
