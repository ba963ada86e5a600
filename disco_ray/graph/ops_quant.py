"""The weight-only quantization op: `dequant` turns a packed weight (`quant`) into the compute
dtype. Kernel in `kernels_quant`."""

from __future__ import annotations

from .dtypes import FLOATS
from .opspec import REQUIRED, OpSpec, numel, register
from .quant import Quant


def _infer_dequant(shapes, dtypes, attrs):
    (w,) = shapes
    bits, group, cols, dtype = attrs["bits"], attrs["group"], attrs["cols"], attrs["dtype"]
    if not isinstance(cols, int) or isinstance(cols, bool) or cols < 1:
        raise ValueError(f"dequant: attribute cols must be an integer >= 1, got {cols!r}")
    if dtype not in FLOATS:
        raise ValueError(f"dequant: attribute dtype must be a floating dtype, got {dtype!r}")
    try:
        q = Quant(bits, group)
    except Exception as e:  # UsageError: a bad bits or group, said as the op's reason
        raise ValueError(f"dequant: {e}") from None
    if dtypes[0] != "uint8" or len(w) != 2 or w[1] != q.packed_shape((1, cols))[1]:
        want = q.packed_shape((max(w[0], 1) if w else 1, cols))
        raise ValueError(f"dequant: the packed weight must be uint8 {list(want)}, got {dtypes[0]} {list(w)}")
    return (w[0], cols), dtype


register(
    OpSpec(
        "dequant",
        1,
        1,
        _infer_dequant,
        attrs={"bits": REQUIRED, "group": REQUIRED, "cols": REQUIRED, "dtype": "float32"},
        flops=lambda s, o, a: 2.0 * numel(o),
        doc="a weight [n, cols] in `dtype` from its packed uint8 form [n, codes | scales | zeros] "
        "(docs/QUANTIZATION.md): group-wise min-max, `bits` 8 or 4 per code, `group` codes per "
        "float16 scale and zero point: code * scale + zero",
    )
)
