"""The quantization ops: `dequant` turns a packed weight (`quant` says the layout) into the
compute dtype; `qlinear` multiplies by one and `qembedding` looks rows of one up, without a float
copy of it in the arena; `quant` packs rows as they are made (a KV cache row,
docs/QUANTIZATION.md). Kernels in `kernels_quant`."""

from __future__ import annotations

from .dtypes import FLOATS
from .opspec import ATTR_TYPES, REQUIRED, OpSpec, _is_int, no_flops, numel, register
from .quant import Layout, Quant

ATTR_TYPES[("dequant", "stop")] = (lambda x: x is None or _is_int(x), "null or an integer")


def _packed_operand(op: str, w: tuple, dtype: str, attrs) -> Quant:
    """The quantization of packed weight operand `w` (shape, dtype) that `attrs` describe."""
    bits, group, cols, layout = attrs["bits"], attrs["group"], attrs["cols"], attrs["layout"]
    if not isinstance(cols, int) or isinstance(cols, bool) or cols < 1:
        raise ValueError(f"{op}: attribute cols must be an integer >= 1, got {cols!r}")
    if layout not in {m.value for m in Layout}:
        raise ValueError(f"{op}: attribute layout must be 'rows' or 'cpu', got {layout!r}")
    try:
        q = Quant(bits, group, Layout(layout))
    except Exception as e:  # UsageError: a bad bits or group, said as the op's reason
        raise ValueError(f"{op}: {e}") from None
    if dtype != "uint8" or len(w) != 2 or w[1] != q.packed_shape((1, cols))[1]:
        want = q.packed_shape((max(w[0], 1) if w else 1, cols))
        raise ValueError(f"{op}: the packed weight must be uint8 {list(want)}, got {dtype} {list(w)}")
    if q.layout is Layout.CPU and not q.fits_cpu((w[0], cols)):
        raise ValueError(f"{op}: layout 'cpu' needs rows a multiple of 64 and whole groups of 32..256")
    return q


def _infer_dequant(shapes, dtypes, attrs):
    (w,) = shapes
    start, stop, dtype = attrs["start"], attrs["stop"], attrs["dtype"]
    n = w[0] if w else 0
    stop = n if stop is None else stop
    if not 0 <= start < stop <= n:
        raise ValueError(f"dequant: rows {start}:{stop} are not a range of the weight's {n}")
    if dtype not in FLOATS:
        raise ValueError(f"dequant: attribute dtype must be a floating dtype, got {dtype!r}")
    _packed_operand("dequant", w, dtypes[0], attrs)
    return (stop - start, attrs["cols"]), dtype


def _infer_qembedding(shapes, dtypes, attrs):
    ids, table = shapes
    if len(ids) < 1 or dtypes[0] not in ("int32", "int64"):
        raise ValueError(f"qembedding: ids must be integers [t] or [.., t], got {list(ids)} {dtypes[0]}")
    if not _is_int(attrs["start"]):
        raise ValueError(f"qembedding: attribute start must be an integer, got {attrs['start']!r}")
    if attrs["dtype"] not in FLOATS:
        raise ValueError(f"qembedding: attribute dtype must be a floating dtype, got {attrs['dtype']!r}")
    _packed_operand("qembedding", table, dtypes[1], attrs)
    return (*ids, attrs["cols"]), attrs["dtype"]


def _infer_qlinear(shapes, dtypes, attrs):
    x, w = shapes
    if dtypes[0] not in FLOATS or len(x) < 1 or x[-1] != attrs["cols"]:
        raise ValueError(
            f"qlinear needs x [.., {attrs['cols']}] of a floating dtype, got {dtypes[0]} {list(x)}"
        )
    _packed_operand("qlinear", w, dtypes[1], attrs)
    return (*x[:-1], w[0]), dtypes[0]


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
            "layout": "rows",
        },
        flops=lambda s, o, a: 2.0 * numel(o),
        doc="a weight [n, cols] in `dtype` from its packed uint8 form [n, codes | scales | zeros] "
        "(docs/QUANTIZATION.md): group-wise min-max, `bits` 8 or 4 per code, `group` codes per "
        "float16 scale and zero point: code * scale + zero; rows start..stop-1 only (stop null: to the end); "
        "layout 'cpu': the bytes as `qlinear`'s CPU kernel reads them",
    )
)
register(
    OpSpec(
        "qlinear",
        2,
        2,
        _infer_qlinear,
        attrs={"bits": REQUIRED, "group": REQUIRED, "cols": REQUIRED, "layout": "rows"},
        flops=lambda s, o, a: 2.0 * numel(o) * a["cols"],
        doc="x [.., cols] @ w^T for a packed weight w [n, ..] (as `dequant` reads it) -> [.., n] in x's "
        "dtype, with no float copy of w in the arena; layout 'cpu' on a CPU: torch's int4 matmul kernel "
        "with x in bfloat16 (int8: one call per nibble plane), else dequantized in the kernel's workspace",
    )
)
register(
    OpSpec(
        "qembedding",
        2,
        2,
        _infer_qembedding,
        attrs={
            "bits": REQUIRED,
            "group": REQUIRED,
            "cols": REQUIRED,
            "layout": "rows",
            "start": 0,
            "dtype": "float32",
        },
        flops=no_flops,
        doc="the rows ids - start [.., t] of a packed table [rows, ..] (as `dequant` reads it) in `dtype` "
        "-> [.., t, cols]; an id outside start..start+rows-1: zeros (a vocabulary shard's lookup)",
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
