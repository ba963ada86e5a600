"""The quantization ops: `dequant` turns a packed weight (`quant` says the layout) into the
compute dtype; `quant` packs rows as they are made (a KV cache row, docs/QUANTIZATION.md).
Kernels in `kernels_quant`."""

from __future__ import annotations

from .dtypes import FLOATS
from .opspec import ATTR_TYPES, REQUIRED, OpSpec, _is_int, numel, register
from .quant import Quant

ATTR_TYPES[("dequant", "stop")] = (lambda x: x is None or _is_int(x), "null or an integer")


def _infer_dequant(shapes, dtypes, attrs):
    (w,) = shapes
    bits, group, cols, dtype = attrs["bits"], attrs["group"], attrs["cols"], attrs["dtype"]
    start, stop = attrs["start"], attrs["stop"]
    n = w[0] if w else 0
    stop = n if stop is None else stop
    if not 0 <= start < stop <= n:
        raise ValueError(f"dequant: rows {start}:{stop} are not a range of the weight's {n}")
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
    return (stop - start, cols), dtype


register(
    OpSpec(
        "dequant",
        1,
        1,
        _infer_dequant,
        attrs={
            "bits": REQUIRED,
            "group": REQUIRED,
            "cols": REQUIRED,
            "dtype": "float32",
            "start": 0,
            "stop": None,
        },
        flops=lambda s, o, a: 2.0 * numel(o),
        doc="a weight [n, cols] in `dtype` from its packed uint8 form [n, codes | scales | zeros] "
        "(docs/QUANTIZATION.md): group-wise min-max, `bits` 8 or 4 per code, `group` codes per "
        "float16 scale and zero point: code * scale + zero; rows start..stop-1 only (stop null: to the end)",
    )
)


def _infer_quant(shapes, dtypes, attrs):
    (x,) = shapes
    if dtypes[0] not in FLOATS:
        raise ValueError(f"quant: the input must be floating, got {dtypes[0]}")
    try:
        q = Quant(attrs["bits"], attrs["group"])
    except Exception as e:  # UsageError: a bad bits or group, said as the op's reason
        raise ValueError(f"quant: {e}") from None
    if len(x) != 2 or min(x) < 1:
        raise ValueError(f"quant: the input must be [rows, cols], got {list(x)}")
    return q.packed_shape(x), "uint8"


register(
    OpSpec(
        "quant",
        1,
        1,
        _infer_quant,
        attrs={"bits": REQUIRED, "group": REQUIRED},
        flops=lambda s, o, a: 4.0 * numel(s[0]),
        doc="rows x [n, cols] packed (uint8 [n, codes | scales | zeros], docs/QUANTIZATION.md): "
        "group-wise min-max along each row, `bits` 8 or 4 per code, `group` elements per float16 "
        "scale and zero point; `dequant`'s inverse (a KV cache row quantized as it is written)",
    )
)
