"""Sources: where a worker reads a graph input itself, instead of receiving it from the caller.

A TaskGraph input may name a `Source`: a tensor of a safetensors file, or a block of it (a range
of rows, of columns, ...). The worker that uses the input reads it once, when the graph is
loaded, with the file memory-mapped and only the block asked for copied out (safetensors'
`get_slice`), converts it to the input's dtype, and keeps it in its host memory for every run of
every graph that names the same source. So a model's weights never pass through the driver, and
with tensor parallelism each worker reads only its own shard of each matrix.

In a TaskGraph document (an addition to docs/FORMATS.md):

    {"id": "l0.wq_g1", "kind": "input", "gpu": 1, "shape": [64, 256], "dtype": "float32",
     "source": {"path": "ckpt/model-00001-of-00002.safetensors",
                "tensor": "model.layers.0.self_attn.q_proj.weight", "slices": [[64, 128]]}}

`slices` gives, per leading dimension, `[start, stop)` or `null` for the whole dimension; the
dimensions it does not name are whole. The block read must have the input's shape. `"finite":
true` (a checkpoint's weights) makes the worker refuse a block holding NaN or infinity when it
reads it (`check_finite`: one float32 sum, half a copy's time), with an error naming the tensor;
read from disk at each load (`actors.tiers.diskio`), a block is checked at its first read of each
version of its file. A source without it may hold them (a mask of -inf).
"""

from __future__ import annotations

import functools
import json
import operator
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import FormatError, NonFiniteError, RunError, UsageError
from .quant import LAYOUT_VERSION, Quant

if TYPE_CHECKING:
    import torch

# the directory of a checkpoint with no files (`Checkpoint.from_config`): its sources refuse to be read
CONFIG_ONLY = "(config only: no weights on disk)"
# a quantized checkpoint's safetensors metadata: the packed layout's version, and per packed
# tensor its float shape, bits and group (JSON): docs/FORMATS.md
LAYOUT_KEY, PACKED_KEY = "disco_ray.layout", "disco_ray.packed"
# safetensors' dtype names -> ours
FILE_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "U8": "uint8",
}


@dataclass(frozen=True, slots=True)
class Source:
    path: str  # a .safetensors file
    tensor: str  # the tensor's name in the file
    slices: tuple[tuple[int, int] | None, ...] = ()  # per leading dim: [start, stop) or whole
    finite: bool = False  # every value must be finite (checked where a worker reads it)
    quant: Quant | None = None  # the block is quantized where it is read, and kept packed
    # with `quant`: the file holds the tensor packed already (`disco-ray quantize`): read as is
    packed: bool = False

    def to_dict(self) -> dict:
        d: dict = {"path": self.path, "tensor": self.tensor}
        if self.slices:
            d["slices"] = [None if s is None else list(s) for s in self.slices]
        if self.finite:
            d["finite"] = True
        if self.quant is not None:
            d["quant"] = self.quant.to_dict()
        if self.packed:
            d["packed"] = True
        return d

    @classmethod
    def from_dict(cls, doc: object, where: str) -> Source:
        """Parses a "source" object; FormatError names `where` (the vertex) and the field."""
        if not isinstance(doc, dict):
            raise FormatError(f'{where}: "source" must be an object with "path" and "tensor"')
        unknown = set(doc) - {"path", "tensor", "slices", "finite", "quant", "packed"}
        if unknown:
            raise FormatError(f'{where}: "source" has unknown field(s) {sorted(unknown)}')
        path, tensor, raw = doc.get("path"), doc.get("tensor"), doc.get("slices", [])
        if not isinstance(path, str) or not path:
            raise FormatError(f'{where}: "source.path" must be a non-empty string, got {path!r}')
        if not isinstance(tensor, str) or not tensor:
            raise FormatError(f'{where}: "source.tensor" must be a non-empty string, got {tensor!r}')
        if not isinstance(raw, (list, tuple)):
            raise FormatError(f'{where}: "source.slices" must be a list, got {raw!r}')
        finite = doc.get("finite", False)
        if not isinstance(finite, bool):
            raise FormatError(f'{where}: "source.finite" must be true or false, got {finite!r}')
        slices: list[tuple[int, int] | None] = []
        for n, s in enumerate(raw):
            if s is None:
                slices.append(None)
                continue
            try:
                if isinstance(s, (str, bytes)) or len(s) != 2 or any(isinstance(x, bool) for x in s):
                    raise TypeError
                a, b = (operator.index(x) for x in s)
            except (TypeError, ValueError):
                raise FormatError(
                    f'{where}: "source.slices[{n}]" must be [start, stop] or null, got {s!r}'
                ) from None
            if not 0 <= a <= b:
                raise FormatError(f'{where}: "source.slices[{n}]" [{a}, {b}] is not a range')
            slices.append((a, b))
        quant = Quant.from_dict(doc["quant"], where) if "quant" in doc else None
        packed = doc.get("packed", False)
        if not isinstance(packed, bool) or (packed and quant is None):
            raise FormatError(
                f'{where}: "source.packed" must be true (with "quant") or false, got {packed!r}'
            )
        return cls(path, tensor, tuple(slices), finite, quant, packed)

    def describe(self) -> str:
        stored = ", stored packed" if self.packed else ""
        packed = "" if self.quant is None else f" ({self.quant.name}, group {self.quant.group}{stored})"
        if not self.slices:
            return f"{self.tensor} of {self.path}{packed}"
        dims = ", ".join(":" if s is None else f"{s[0]}:{s[1]}" for s in self.slices)
        return f"{self.tensor}[{dims}] of {self.path}{packed}"


def read(src: Source, shape: tuple[int, ...], dtype: str, where: str = ""):
    """The block `src` names, as a contiguous CPU tensor of `shape` and `dtype`.

    Raises:
        RunError: the file cannot be read, lacks the tensor, or the block has another shape
            (the message names `where`, the file and the tensor).
    """
    from safetensors import SafetensorError, safe_open

    from .dtypes import torch_dtype

    what = f"{where}: source {src.describe()}" if where else f"source {src.describe()}"
    if src.path.startswith(CONFIG_ONLY):
        raise RunError(
            f"{what}: a config-only checkpoint has no weights to read (it is for planning and simulation)"
        )
    try:
        with safe_open(src.path, framework="pt") as f:
            if src.tensor not in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                raise RunError(f"{what}: the file has no tensor {src.tensor!r}")
            if src.packed:
                return _stored(src, f, shape, dtype, what)
            sl = f.get_slice(src.tensor)
            full = tuple(sl.get_shape())
            if len(src.slices) > len(full):
                raise RunError(f"{what}: {len(src.slices)} slices for a tensor of shape {list(full)}")
            index = []
            for d, s in enumerate(src.slices):
                if s is not None and s[1] > full[d]:
                    raise RunError(f"{what}: slice {s[0]}:{s[1]} of dim {d} exceeds {full[d]}")
                index.append(slice(None) if s is None else slice(*s))
            t = sl[tuple(index)] if index else f.get_tensor(src.tensor)
    except OSError as e:
        raise RunError(f"{what}: cannot read ({e.strerror or e})") from None
    except SafetensorError as e:
        raise RunError(f"{what}: not a readable safetensors file ({e})") from None
    if src.quant is not None:
        return _packed(src.quant, t, shape, dtype, what, src.finite)
    if tuple(t.shape) != tuple(shape):
        raise RunError(f"{what}: has shape {list(t.shape)}, the input {list(shape)}")
    out = t.to(torch_dtype(dtype)).contiguous()
    if src.finite:
        check_finite(out, what, t)
    return out


def packed_records(metadata: dict | None) -> dict[str, tuple[Quant, tuple[int, int]]]:
    """The tensors a safetensors file's `metadata` records packed: name -> (how, float shape);
    none for a file that records none.

    Raises:
        ValueError: another layout version, or a record that is not {bits, group, shape}.
    """
    meta = metadata or {}
    if PACKED_KEY not in meta:
        return {}
    if meta.get(LAYOUT_KEY) != str(LAYOUT_VERSION):
        raise ValueError(
            f"packed layout version {meta.get(LAYOUT_KEY)!r}, this disco-ray reads {LAYOUT_VERSION}"
        )
    out = {}
    try:
        for name, rec in json.loads(meta[PACKED_KEY]).items():
            shape = tuple(operator.index(n) for n in rec["shape"])
            if len(shape) != 2:
                raise ValueError(f"shape {rec['shape']} of {name!r} is not [out, in]")
            out[name] = Quant(rec["bits"], rec["group"]), shape
    except (AttributeError, KeyError, TypeError, ValueError, UsageError) as e:
        raise ValueError(f"metadata {PACKED_KEY!r} is not a record of packed tensors ({e})") from None
    return out  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """The block a packed source names in a tensor its file holds packed (a quantized
    checkpoint's): packed rows [r0, r1) of `width` bytes, of float rows of `cols` elements, of which
    columns `block` (None: all) are the source's; `stored`: how the file packed them (the codes
    the source's `quant` reads; its bytes, once the same, are streamed as they are)."""

    r0: int
    r1: int
    width: int
    cols: int
    block: tuple[int, int] | None
    stored: Quant

    @classmethod
    def of(
        cls, src: Source, metadata: dict | None, file_dtype: str, file_shape: list[int], what: str
    ) -> StoredBlock:
        """Checked against the file's `metadata` record and its tensor's dtype and shape.

        Raises:
            RunError: naming `what`: no record of the tensor, another layout version, bits or
                group, a dtype or shape other than the record packs to, a block outside it or
                cutting its groups.
        """
        assert src.quant is not None
        try:
            rec = packed_records(metadata).get(src.tensor)
        except ValueError as e:
            raise RunError(f"{what}: {e}") from None
        if rec is None or (rec[0].bits, rec[0].group) != (src.quant.bits, src.quant.group):
            how = "no record of it" if rec is None else f"packed {rec[0].name}, group {rec[0].group}"
            raise RunError(f"{what}: the file's metadata has {how}")
        (q, (rows, cols)) = rec
        width = q.packed_shape((rows, cols))[1]
        if file_dtype != "U8" or list(file_shape) != [rows, width]:
            raise RunError(f"{what}: has {file_dtype} {list(file_shape)}, packed it is U8 {[rows, width]}")
        r0, r1 = src.slices[0] if src.slices and src.slices[0] is not None else (0, rows)
        block = src.slices[1] if len(src.slices) > 1 else None
        if len(src.slices) > 2 or r1 > rows or (block is not None and block[1] > cols):
            raise RunError(f"{what}: the block is not one of a tensor of shape {[rows, cols]}")
        if block is not None:
            try:
                q.column_spans(cols, *block)
            except UsageError as e:
                raise RunError(f"{what}: {e}") from None
        return cls(r0, r1, width, cols, block, q)


def packed_columns(rows: torch.Tensor, q: Quant, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """The packed form of columns `block` of packed `rows` [n, width] (float rows of `cols`): the
    bytes packing that block would give (`Quant.column_spans`)."""
    import torch

    out = torch.zeros(rows.shape[0], q.packed_shape((1, block[1] - block[0]))[1], dtype=torch.uint8)
    for a, b, at in q.column_spans(cols, *block):
        out[:, at : at + b - a] = rows[:, a:b]
    return out


def _stored(src: Source, f, shape: tuple[int, ...], dtype: str, what: str):
    """The packed block `src` names of a tensor its file holds packed, read as stored."""
    assert src.quant is not None
    sl = f.get_slice(src.tensor)
    b = StoredBlock.of(src, f.metadata(), sl.get_dtype(), sl.get_shape(), what)
    t = sl[b.r0 : b.r1]
    if b.block is not None:
        t = packed_columns(t, b.stored, b.cols, b.block)
    if b.stored != src.quant:  # the same codes in the CPU kernel's layout: rearranged (once per load)
        from .kernels_quant import to_cpu

        t = to_cpu(t.contiguous(), src.quant, b.block[1] - b.block[0] if b.block else b.cols)
    if dtype != "uint8" or tuple(t.shape) != tuple(shape):
        raise RunError(f"{what}: is {list(t.shape)} uint8 packed, the input {list(shape)} {dtype}")
    return t.contiguous()


def _packed(q: Quant, t: torch.Tensor, shape: tuple[int, ...], dtype: str, what: str, finite: bool):
    """Block `t` quantized by `q`, checked to be the input's packed `shape` (uint8)."""
    from .kernels_quant import quantize

    if t.dim() != 2 or dtype != "uint8" or q.packed_shape(tuple(t.shape)) != tuple(shape):
        got = list(q.packed_shape(tuple(t.shape))) if t.dim() == 2 else f"a {t.dim()}-d block"
        raise RunError(f"{what}: packs to {got} uint8, the input is {list(shape)} {dtype}")
    if finite:  # a NaN or infinity would poison its whole group's scale
        check_finite(t, what)
    try:
        return quantize(t, q)
    except ValueError as e:
        raise RunError(f"{what}: cannot be quantized: {e}") from None


def check_finite(t: torch.Tensor, what: str, stored: torch.Tensor | None = None) -> None:
    """NonFiniteError naming `what` unless every value of tensor `t` is finite.

    One float32-accumulated sum, where a NaN or an infinity anywhere shows (about 8 GB/s on one
    core, against 0.6 GB/s for `isfinite().all()`, which makes a mask); only a sum that is not
    finite makes the values counted, so finite values whose sum overflows pass. `stored`: the
    values as the file holds them, to tell a dtype conversion's overflow from the file's own.
    """
    import math

    import torch

    if not t.is_floating_point() or not t.numel() or math.isfinite(float(t.sum(dtype=torch.float32))):
        return
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    if not nan and not inf:
        return
    where = int((~torch.isfinite(t.reshape(-1))).nonzero()[0])
    index = list(torch.unravel_index(torch.tensor(where), t.shape)) if t.dim() > 1 else [where]
    first = ", ".join(str(int(i)) for i in index)
    why = ""
    if stored is not None and stored.is_floating_point() and bool(torch.isfinite(stored).all()):
        why = f" (finite in the file: they overflow {str(t.dtype).removeprefix('torch.')})"
    raise NonFiniteError(
        f"{what}: {nan} NaN and {inf} infinite values of {t.numel()}, the first at [{first}]{why}"
    )


def header(path: str, where: str = "") -> dict:
    """The JSON header of safetensors file `path` (tensor -> dtype, shape, data_offsets), with
    "__data_start__", the file offset its data offsets count from; read once per file version."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise RunError(
            f"{where + ': ' if where else ''}source file {path}: cannot read ({e.strerror})"
        ) from None
    return _header(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _header(path: str, mtime_ns: int, size: int) -> dict:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise RunError(f"{path}: not a safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise RunError(f"{path}: not a safetensors file (header of {n} bytes in a file of {size})")
        try:
            doc = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RunError(f"{path}: not a safetensors file ({e})") from None
    doc["__data_start__"] = 8 + n
    return doc
