"""Weight-only quantization: what a packed weight is, its size, and its use in a graph (pure, no torch).

A linear weight [out, in] is quantized group-wise along its input dimension, min-max asymmetric
as FlexGen does (Sheng et al., 2023, section 5): each group of `group` consecutive elements of a
row gets a scale s = (max - min) / (2^bits - 1) and a zero point z = min, each element the code
q = round((x - z) / s) in 0..2^bits-1, and dequantizes to q * s + z. A row whose length is not a
multiple of `group` has a shorter last group (its min and max are over the elements it has).

The packed weight is one uint8 tensor [out, width], one packed row per weight row:

    codes (cb bytes) | scales (ng float16) | zeros (ng float16)

with ng = ceil(in / group) groups and cb = 2 * ceil(in * bits / 16) bytes of codes (int8: one
byte per element; int4: two per byte, element 2i in the low nibble, 2i+1 in the high one; padded
to an even count so the float16s that follow are aligned). So a planner that sizes a graph input
by its shape and dtype moves and keeps the packed bytes: with group 64, 1.06 bytes per weight for
int8 and 0.56 for int4, against 4 (float32) or 2 (float16). This is `Layout.ROWS`, the portable
layout: what files hold and what `dequant` and the embedding lookup read.

`Layout.CPU` is the same bytes rearranged for torch's CPU int4 matmul kernel, which the
`qlinear` op calls (`kernels_quant.to_cpu`; only where `Quant.fits_cpu`): first the codes as
`torch.ops.aten._convert_weight_to_int4pack_for_cpu` lays out an [out, in] matrix of 4-bit codes
(blocks of 64 rows; in each, per input column, 32 bytes: row r's code in the low nibble of byte
r, row r + 32's in the high one), int8 as two such planes (the codes' high nibbles, then their low
ones); then bfloat16 [ng, out, 2]: per group and row (scale * 2^(bits-4), zero + 2^(bits-1) *
scale), since the kernel computes (code - 8) * scale' + zero' per plane. A worker writes it where
it quantizes a block (its host store, its packed file), so the arena and the planner see the
same byte count either way.

The worker quantizes when it reads a block of the checkpoint (`sources.Source.quant`); the
`dequant` op (`ops_quant`, kernel in `kernels_quant`) turns a packed weight back into the
compute dtype on the device that uses it, just before the `linear` or `matmul` that reads it
(`workloads.llm.packed.dequantized` adds it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from .errors import FormatError, UsageError

BITS = (8, 4)  # the code widths: int8 and int4
# the packed layout's version, written in a quantized checkpoint (`disco-ray quantize`): bump it
# with any change to the layout below, so that a checkpoint packed otherwise is refused, not misread
LAYOUT_VERSION = 1
NAMES = {"int8": 8, "int4": 4}  # --quantize's values -> bits
DEFAULT_GROUP = 64  # FlexGen's group size
CPU_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes
CPU_ROWS = 64  # its row block: Layout.CPU needs a multiple of it


class Layout(str, Enum):
    """How a packed weight's bytes are arranged (the same count either way)."""

    ROWS = "rows"  # row by row: codes, scales, zeros (the portable layout)
    CPU = "cpu"  # for torch's CPU int4 matmul kernel (`qlinear`), where `Quant.fits_cpu`


KV_NAMES = {"int8": 8}  # --kv-cache's packed values -> bits ("float": the compute dtype)


def kv_quant(name: str | None, head_dim: int, group: int | None = None) -> Quant | None:
    """The KV cache's packing: `name` "int8" (None or "float": the compute dtype's floats), one
    scale and zero point per `group` elements (default: a head's row, `head_dim`), so a group never
    straddles two heads: `group` must divide `head_dim`. UsageError naming the value otherwise."""
    if name is None or name == "float":
        if group is not None:  # a group with nothing to group is a mistaken request
            raise UsageError(f"kv_group {group!r} takes kv_cache int8, got kv_cache {name!r}")
        return None
    if name not in KV_NAMES:
        raise UsageError(f"kv_cache must be int8 or float, got {name!r}")
    if group is not None and (
        not isinstance(group, int) or isinstance(group, bool) or group < 1 or head_dim % group
    ):
        raise UsageError(
            f"kv_group must divide the head dimension {head_dim} (a group within a head), got {group!r}"
        )
    return Quant(KV_NAMES[name], head_dim if group is None else group)


@dataclass(frozen=True, slots=True)
class Quant:
    """How a weight is quantized: `bits` per code and `group` elements per scale and zero point."""

    bits: int
    group: int = DEFAULT_GROUP
    layout: Layout = Layout.ROWS

    def __post_init__(self) -> None:
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise UsageError(f"quantization bits must be 8 or 4, got {self.bits!r}")
        if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 1:
            raise UsageError(f"quantization group must be an integer >= 1, got {self.group!r}")
        if not isinstance(self.layout, Layout):
            raise UsageError(f"quantization layout must be one of rows, cpu, got {self.layout!r}")

    @classmethod
    def named(cls, name: str | None, group: int = DEFAULT_GROUP) -> Quant | None:
        """The quantization `name` ("int8", "int4"; None or "none": none) with `group`."""
        if name is None or name == "none":
            return None
        if name not in NAMES:
            raise UsageError(f"quantize must be one of int8, int4 (or none), got {name!r}")
        return cls(NAMES[name], group)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def groups(self, cols: int) -> int:
        """Groups of a row of `cols` elements."""
        return -(-cols // self.group)

    def code_bytes(self, cols: int) -> int:
        """Bytes of a row's codes (an even count: the float16 scales after them stay aligned)."""
        return 2 * (-(-cols * self.bits // 16))

    def column_spans(self, cols: int, c0: int, c1: int) -> tuple[tuple[int, int, int], ...]:
        """How the packed form of columns [c0, c1) of rows of `cols` elements is cut out of the
        whole rows' packed form: (from, to, at) byte ranges of a packed row, copied to offset `at`
        of the block's packed row (its other bytes are zero, as `kernels_quant.quantize` pads).
        The same bytes as packing the block itself, which needs the block to start on a group
        (and, int4, on a whole byte) and end on one or at the row's end.

        Raises:
            UsageError: the block does not fall on those boundaries.
        """
        if not 0 <= c0 < c1 <= cols:
            raise UsageError(f"columns {c0}:{c1} are not a range of a row of {cols}")
        per_byte = 8 // self.bits
        if c0 % self.group or c0 % per_byte or (c1 != cols and (c1 % self.group or c1 % per_byte)):
            raise UsageError(
                f"columns {c0}:{c1} of a row of {cols} do not start and end on groups of {self.group}"
            )
        n, g0, g1 = c1 - c0, c0 // self.group, self.groups(c1)
        cb, own = self.code_bytes(cols), self.code_bytes(n)
        ng = g1 - g0
        return (
            (c0 // per_byte, c0 // per_byte + -(-n // per_byte), 0),  # the codes
            (cb + 2 * g0, cb + 2 * g1, own),  # the scales
            (cb + 2 * (self.groups(cols) + g0), cb + 2 * (self.groups(cols) + g1), own + 2 * ng),  # zeros
        )

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The packed uint8 shape of a weight of `shape` [out, in]."""
        if len(shape) != 2 or min(shape) < 1:
            raise UsageError(f"only a 2-d weight [out, in] is quantized, got shape {list(shape)}")
        rows, cols = shape
        return rows, self.code_bytes(cols) + 4 * self.groups(cols)

    def fits_cpu(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of `shape` [out, in] can take Layout.CPU (torch's kernel's limits)."""
        rows, cols = shape
        return self.group in CPU_GROUPS and rows % CPU_ROWS == 0 and cols % self.group == 0

    def for_weight(self, shape: tuple[int, ...]) -> Quant:
        """This quantization for a weight of `shape`: Layout.ROWS where Layout.CPU does not fit."""
        if self.layout is Layout.CPU and not self.fits_cpu(shape):
            return replace(self, layout=Layout.ROWS)
        return self

    def to_dict(self) -> dict:
        d: dict = {"bits": self.bits, "group": self.group}
        if self.layout is not Layout.ROWS:
            d["layout"] = self.layout.value
        return d

    @classmethod
    def from_dict(cls, doc: object, where: str) -> Quant:
        """Parses a source's "quant" object; FormatError names `where` and the field."""
        if not isinstance(doc, dict) or set(doc) - {"bits", "group", "layout"} or "bits" not in doc:
            raise FormatError(
                f'{where}: "source.quant" must be {{"bits": 8 or 4, "group": n, "layout": "rows" or "cpu"}}, '
                f"got {doc!r}"
            )
        layout = doc.get("layout", Layout.ROWS.value)
        if layout not in {m.value for m in Layout}:
            raise FormatError(f'{where}: "source.quant.layout" must be "rows" or "cpu", got {layout!r}')
        try:
            return cls(doc["bits"], doc.get("group", DEFAULT_GROUP), Layout(layout))
        except UsageError as e:
            raise FormatError(f'{where}: "source.quant": {e}') from None
