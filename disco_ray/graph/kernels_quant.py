"""Group-wise min-max quantization in torch (`quant` says the packed layouts): `quantize` (where a
worker reads a weight) and the `quant` op's kernel (a KV cache row as it is written),
`dequantize`, and the kernels of the `dequant`, `qlinear` and `qembedding` ops (on the device
that uses the weight).

`qlinear` on a Layout.CPU weight calls torch's `_weight_int4pack_mm_for_cpu` (int8: twice, once
per nibble plane) with the activations in bfloat16, the only input dtype for which torch 2.13
has a vectorized CPU path (float32 runs a scalar loop, 10-70x slower than float32 `linear`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .quant import CPU_ROWS, Layout, Quant

# the most rows of x for which qlinear calls the int4 kernel: its time grows with the rows as a
# matrix-vector product's (measured: past 64 rows, dequantizing then `matmul` is faster)
KERNEL_ROWS = 64

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]


def quantize(w: torch.Tensor, q: Quant) -> torch.Tensor:
    """The packed uint8 form [out, width] of weight `w` [out, in] (any float dtype)."""
    out = torch.empty(q.packed_shape(tuple(w.shape)), dtype=torch.uint8, device=w.device)
    if not _quant_into(out, w, q):
        raise ValueError("values beyond float16's range (65504): a scale or zero point overflows")
    return to_cpu(out, q, w.shape[1]) if q.layout is Layout.CPU else out


def _quant_into(out: torch.Tensor, w: torch.Tensor, q: Quant, check: bool = True) -> bool:
    """Packs `w` [rows, cols] into `out` [rows, width] (uint8); with `check`, False when a scale or
    zero point overflows float16 (a host sync: a kernel skips it, the logits' check sees the NaN)."""
    rows, cols = w.shape
    if q.layout is Layout.CPU and not q.fits_cpu((rows, cols)):
        raise ValueError(
            f"layout cpu needs rows a multiple of {CPU_ROWS} and whole groups, got {rows} x {cols}"
        )
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


def _cpu_codes(planes: list[torch.Tensor], cols: int, blocks: slice | torch.Tensor, j=None) -> torch.Tensor:
    """The codes (uint8) of a Layout.CPU weight's row `blocks` (a slice: every row of them, a
    strided [block, 2, 32, cols] view, row 32 h + i of a block at [block, h, i]), or of row j of
    each of the blocks (a tensor, with `j`: [n, cols])."""
    code = None
    for plane in planes:  # [block, col, 32] bytes: row r's in byte r % 32, nibble by the half
        b = plane.reshape(-1, cols, CPU_ROWS // 2)
        if j is None:
            nib = torch.stack([b[blocks] & 15, b[blocks] >> 4], dim=1).transpose(2, 3)
        else:
            row = b[blocks, :, j % (CPU_ROWS // 2)]
            nib = torch.where((j >= CPU_ROWS // 2)[:, None], row >> 4, row & 15)
        code = nib if code is None else (code << 4) | nib
    assert code is not None
    return code


def _cpu_rows(out: torch.Tensor, packed: torch.Tensor, q: Quant, rows: int | torch.Tensor) -> None:
    """Rows of a Layout.CPU weight, as `qlinear`'s kernel reads them, into `out` [n, cols]:
    rows..rows+n-1 (an int), or the rows that int64 tensor `rows` [n] names."""
    n, cols = out.shape
    planes, sz = _cpu_parts(packed, q, cols)
    lift = 1 << (q.bits - 4)
    idx: slice | torch.Tensor = slice(rows, rows + n) if isinstance(rows, int) else rows
    s = sz[:, idx, 0].float().t() / lift
    z = sz[:, idx, 1].float().t() - 8 * lift * s
    direct = out.dtype == torch.float32 and out.is_contiguous()
    if isinstance(rows, int):  # whole blocks, unpermuted by the copy into floats
        b0, b1 = rows // CPU_ROWS, -(-(rows + n) // CPU_ROWS)
        whole = direct and rows == b0 * CPU_ROWS and n == (b1 - b0) * CPU_ROWS
        full = out if whole else torch.empty((b1 - b0) * CPU_ROWS, cols, device=out.device)
        full.view(b1 - b0, 2, CPU_ROWS // 2, cols).copy_(_cpu_codes(planes, cols, slice(b0, b1)))
        full = full[rows - b0 * CPU_ROWS : rows - b0 * CPU_ROWS + n]
    else:
        full = out if direct else torch.empty(n, cols, device=out.device)
        full.copy_(_cpu_codes(planes, cols, rows // CPU_ROWS, rows % CPU_ROWS))
    g = full.view(n, q.groups(cols), q.group)
    g.mul_(s[..., None]).add_(z[..., None])
    if full is not out:
        out.copy_(full)


def dequantize(packed: torch.Tensor, q: Quant, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight [out, cols] in `dtype` from its packed form (`quantize`'s)."""
    out = torch.empty(packed.shape[0], cols, dtype=dtype, device=packed.device)
    if q.layout is Layout.CPU:
        _cpu_rows(out, packed, q, 0)
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
        _cpu_rows(out, ins[0], q, attrs["start"])
    else:
        _dequant_into(out, ins[0][attrs["start"] : attrs["start"] + out.shape[0]], q)


def _qembedding(out, ins, attrs):
    ids, table = ins
    q, cols = Quant(attrs["bits"], attrs["group"], Layout(attrs["layout"])), attrs["cols"]
    local = (ids - attrs["start"]).reshape(-1)
    inside = (local >= 0) & (local < table.shape[0])  # a row outside the shard: zeros
    flat = out.view(-1, cols)
    idx = local.clamp(0, table.shape[0] - 1)
    if q.layout is Layout.CPU:
        _cpu_rows(flat, table, q, idx)
    else:
        _dequant_into(flat, table.index_select(0, idx), q)
    flat.mul_(inside.unsqueeze(1).to(out.dtype))


def _qlinear(out, ins, attrs):
    x, w = ins
    q, cols = Quant(attrs["bits"], attrs["group"], Layout(attrs["layout"])), attrs["cols"]
    if q.layout is not Layout.CPU or x.device.type != "cpu" or x.numel() > cols * KERNEL_ROWS:
        # no fused kernel, or rows enough that a float matrix product pays: dequantize, multiply
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
    rows, cols = out.shape
    q = Quant(attrs["bits"], attrs["group"])
    if attrs.get("layout", Layout.ROWS.value) == Layout.CPU.value:
        # the covering 64-row blocks' codes and nibbles (uint8) and floats, scales and zeros
        return (rows + 2 * CPU_ROWS) * 8 * cols + rows * 16 * q.groups(cols)
    # the float32 codes (a row rounded up to whole groups), the unpacked nibbles, the scales
    return rows * (4 * q.groups(cols) * q.group + 2 * q.code_bytes(cols) + 16 * q.groups(cols))


def _qlinear_temps(out, ins, attrs):
    x, w = ins
    rows, cols = w.shape[0], attrs["cols"]
    if attrs["layout"] != Layout.CPU.value or x.device.type != "cpu" or x.numel() > cols * KERNEL_ROWS:
        return rows * cols * x.element_size() + _dequant_temps(
            torch.empty(rows, cols, device="meta"), [w], attrs
        )
    # activations and two products in bfloat16, the low plane's scales
    return 2 * x.numel() + 4 * out.numel() + 4 * rows * Quant(attrs["bits"], attrs["group"]).groups(cols)


def _qembedding_temps(out, ins, attrs):
    n, cols = out.numel() // attrs["cols"], attrs["cols"]
    q = Quant(attrs["bits"], attrs["group"])
    # the ids, the packed rows or their codes and nibbles, float32 codes, scales and zeros
    return 24 * n + n * (q.packed_shape((1, cols))[1] + 4 * cols) + 4 * n * cols + 16 * n * q.groups(cols)


KERNELS: dict[str, Impl] = {
    "dequant": _dequant,
    "qlinear": _qlinear,
    "qembedding": _qembedding,
    "quant": _quant,
}
TEMPS: dict[str, TempBytes] = {
    "dequant": _dequant_temps,
    "qlinear": _qlinear_temps,
    "qembedding": _qembedding_temps,
    "quant": _quant_temps,
}
