"""Group-wise min-max quantization in torch (`quant` says the packed layouts): `quantize` (where a
worker reads a weight), `dequantize`, the `dequant` op's kernel and the `qlinear` op's (on the
device that uses the weight).

`qlinear` on a Layout.CPU weight calls torch's `_weight_int4pack_mm_for_cpu` (int8: twice, once
per nibble plane) with the activations in bfloat16, the only input dtype for which torch 2.13
has a vectorized CPU path (float32 runs a scalar loop, 10-70x slower than float32 `linear`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .quant import CPU_ROWS, Layout, Quant

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
    return to_cpu(out, q, cols) if q.layout is Layout.CPU else out


def to_cpu(packed: torch.Tensor, q: Quant, cols: int) -> torch.Tensor:
    """Layout.ROWS `packed` [out, width] rearranged into Layout.CPU (same shape and byte count)."""
    rows, width = packed.shape
    ng, cb = q.groups(cols), q.code_bytes(cols)
    codes = packed[:, :cb]
    if q.bits == 4:  # element 2i in the low nibble: unpacked in order
        planes = [torch.stack([codes & 15, codes >> 4], dim=-1).view(rows, cols)]
    else:  # int8: the high nibbles' plane, then the low ones'
        planes = [codes >> 4, codes & 15]
    out = torch.empty(rows * width, dtype=torch.uint8, device=packed.device)
    n = rows * cols // 2
    for k, plane in enumerate(planes):  # [block, half, 32, col] -> [block, col, 32]: half as nibble
        c = plane.reshape(rows // CPU_ROWS, 2, CPU_ROWS // 2, cols).permute(0, 3, 1, 2)
        out[k * n : (k + 1) * n].view(rows // CPU_ROWS, cols, CPU_ROWS // 2).copy_(
            c[:, :, 0] | (c[:, :, 1] << 4)
        )
    sz = packed[:, cb:].contiguous().view(torch.float16).view(rows, 2, ng).float()
    lift = 1 << (q.bits - 4)  # a plane's code counts lift times the low plane's (int8's high nibble: 16)
    s, z = sz[:, 0] * lift, sz[:, 1] + 8 * lift * sz[:, 0]  # the kernel computes (code - 8) * s + z
    out[rows * cb :].view(torch.bfloat16).view(ng, rows, 2).copy_(torch.stack([s, z], dim=-1).transpose(0, 1))
    return out.view(rows, width)


def _cpu_parts(packed: torch.Tensor, q: Quant, cols: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A Layout.CPU weight's code planes ([out, cols / 2] uint8 each) and scales and zeros
    (bfloat16 [groups, out, 2]), as views of its bytes."""
    rows = packed.shape[0]
    flat, n = packed.view(-1), rows * cols // 2
    planes = [flat[k * n : (k + 1) * n].view(rows, cols // 2) for k in range(q.bits // 4)]
    sz = flat[rows * q.code_bytes(cols) :].view(torch.bfloat16).view(q.groups(cols), rows, 2)
    return planes, sz


def _cpu_dequant_into(out: torch.Tensor, packed: torch.Tensor, q: Quant, start: int) -> None:
    """Rows start.. of a Layout.CPU weight, as `qlinear`'s kernel reads them, into `out`."""
    cols = out.shape[1]
    planes, sz = _cpu_parts(packed, q, cols)
    rows = packed.shape[0]
    code = torch.zeros(rows, cols, dtype=torch.uint8, device=packed.device)
    for plane in planes:  # [block, col, 32] bytes -> [block, half, 32, col] nibbles
        b = plane.reshape(rows // CPU_ROWS, cols, CPU_ROWS // 2)
        nib = torch.stack([b & 15, b >> 4], dim=1).permute(0, 1, 3, 2).reshape(rows, cols)
        code = (code << 4) | nib
    lift = 1 << (q.bits - 4)
    s = sz[..., 0].float().t() / lift
    z = sz[..., 1].float().t() - 8 * lift * s
    stop = start + out.shape[0]
    w = code[start:stop].float().view(-1, q.groups(cols), q.group)
    out.copy_(w.mul_(s[start:stop, :, None]).add_(z[start:stop, :, None]).view(out.shape))


def dequantize(packed: torch.Tensor, q: Quant, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight [out, cols] in `dtype` from its packed form (`quantize`'s)."""
    out = torch.empty(packed.shape[0], cols, dtype=dtype, device=packed.device)
    if q.layout is Layout.CPU:
        _cpu_dequant_into(out, packed, q, 0)
    else:
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
    q = Quant(attrs["bits"], attrs["group"], Layout(attrs["layout"]))
    if q.layout is Layout.CPU:
        _cpu_dequant_into(out, ins[0], q, attrs["start"])
    else:
        _dequant_into(out, ins[0][attrs["start"] : attrs["start"] + out.shape[0]], q)


def _qlinear(out, ins, attrs):
    x, w = ins
    q, cols = Quant(attrs["bits"], attrs["group"], Layout(attrs["layout"])), attrs["cols"]
    if q.layout is not Layout.CPU or x.device.type != "cpu":  # no fused kernel: dequantize, multiply
        wf = torch.empty(w.shape[0], cols, dtype=x.dtype, device=x.device)
        _dequant(wf, [w], {**attrs, "start": 0})
        torch.matmul(x, wf.t(), out=out)
        return
    planes, sz = _cpu_parts(w, q, cols)
    xb = x.reshape(-1, cols).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, planes[0], q.group, sz)
    if len(planes) == 2:  # int8's low nibbles: scale s (the high plane's / 16), zero 8 s (its / 2)
        low = sz[..., :1] * torch.tensor([1 / 16, 1 / 2], dtype=torch.bfloat16, device=sz.device)
        out.copy_(y.view(out.shape))  # summed in the output's dtype, not in bfloat16
        out.add_(torch.ops.aten._weight_int4pack_mm_for_cpu(xb, planes[1], q.group, low).view(out.shape))
    else:
        out.copy_(y.view(out.shape))


def _dequant_temps(out, ins, attrs):
    rows, cols = out.shape
    q = Quant(attrs["bits"], attrs["group"])
    if attrs.get("layout", Layout.ROWS.value) == Layout.CPU.value:
        # every row's codes and nibbles (uint8), the span's float32 codes, every row's scales
        n = ins[0].shape[0]
        return 5 * n * cols + 4 * rows * cols + 16 * n * q.groups(cols)
    # the float32 codes (a row rounded up to whole groups), the unpacked nibbles, the scales
    return rows * (4 * q.groups(cols) * q.group + 2 * q.code_bytes(cols) + 16 * q.groups(cols))


def _qlinear_temps(out, ins, attrs):
    x, w = ins
    rows, cols = w.shape[0], attrs["cols"]
    if attrs["layout"] != Layout.CPU.value or x.device.type != "cpu":  # the float weight, its dequant's
        return rows * cols * x.element_size() + _dequant_temps(
            torch.empty(rows, cols, device="meta"), [w], attrs
        )
    # activations and two products in bfloat16, the low plane's scales
    return 2 * x.numel() + 4 * out.numel() + 4 * rows * Quant(attrs["bits"], attrs["group"]).groups(cols)


KERNELS: dict[str, Impl] = {"dequant": _dequant, "qlinear": _qlinear}
TEMPS: dict[str, TempBytes] = {"dequant": _dequant_temps, "qlinear": _qlinear_temps}
