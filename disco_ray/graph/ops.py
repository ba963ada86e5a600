"""The op set: each op's arity, attributes and shape/dtype inference (pure, no torch).

The torch implementations live in `disco_ray.graph.kernels`; they write into a given output view so
the runtime can run them on arena views on the CPU or a GPU. New ops register with `register`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .dtypes import FLOATS

Shape = tuple[int, ...]
Infer = Callable[[list[Shape], list[str], Mapping], tuple[Shape, str]]


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One operation: `infer` raises ValueError with a plain reason when operands do not fit."""

    name: str
    min_arity: int
    max_arity: int | None  # None: any number >= min_arity
    infer: Infer
    attrs: Mapping[str, object] = field(default_factory=dict)  # name -> default (REQUIRED if none)
    flops: Callable[[list[Shape], Shape, Mapping], float] | None = None
    doc: str = ""

    def check_arity(self, n: int) -> str | None:
        if n < self.min_arity or (self.max_arity is not None and n > self.max_arity):
            want = (
                f"{self.min_arity}"
                if self.max_arity == self.min_arity
                else f"{self.min_arity}..{self.max_arity if self.max_arity is not None else 'n'}"
            )
            return f"op {self.name} takes {want} operands, got {n}"
        return None

    def full_attrs(self, attrs: Mapping) -> dict:
        """Attributes with defaults filled in; raises ValueError for unknown or missing ones."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ValueError(f"op {self.name} has no attribute(s) {sorted(unknown)}")
        out = {}
        for k, default in self.attrs.items():
            if k in attrs:
                out[k] = attrs[k]
            elif default is REQUIRED:
                raise ValueError(f"op {self.name} needs attribute {k!r}")
            else:
                out[k] = default
        return out


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    OPS[spec.name] = spec
    return spec


def get(name: str) -> OpSpec:
    return OPS[name]


def numel(shape: Shape) -> int:
    return math.prod(shape)


def _same_dtype(name: str, dtypes: list[str], floats: bool = True) -> str:
    if len(set(dtypes)) != 1:
        raise ValueError(f"{name} operands have different dtypes {dtypes}")
    if floats and dtypes[0] not in FLOATS:
        raise ValueError(f"{name} needs a floating dtype, got {dtypes[0]}")
    return dtypes[0]


def _broadcast(a: Shape, b: Shape) -> Shape:
    out = []
    for x, y in zip(reversed(a), reversed(b)):
        if x != y and 1 not in (x, y):
            raise ValueError(f"batch dims {a} and {b} do not broadcast")
        out.append(max(x, y))
    longer = a if len(a) > len(b) else b
    return tuple(longer[: len(longer) - len(out)]) + tuple(reversed(out))


def _infer_matmul(shapes, dtypes, attrs):
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"matmul needs operands of rank >= 2, got {list(a)} and {list(b)}")
    if a[-1] != b[-2]:
        raise ValueError(f"matmul inner dims differ: {list(a)} @ {list(b)}")
    batch = _broadcast(a[:-2], b[:-2])
    return (*batch, a[-2], b[-1]), _same_dtype("matmul", dtypes)


def _flops_matmul(shapes, out, attrs):
    return 2.0 * numel(out) * shapes[0][-1]


def _infer_same_shape(name: str, floats: bool = False):
    def infer(shapes, dtypes, attrs):
        if len(set(shapes)) != 1:
            raise ValueError(f"{name} operands have different shapes {[list(s) for s in shapes]}")
        return shapes[0], _same_dtype(name, dtypes, floats=floats)

    return infer


def _infer_unary_float(name: str, min_rank: int = 0):
    def infer(shapes, dtypes, attrs):
        (s,) = shapes[:1]
        if len(s) < min_rank:
            raise ValueError(f"{name} needs rank >= {min_rank}, got shape {list(s)}")
        return s, _same_dtype(name, dtypes[:1])

    return infer


def _infer_rmsnorm(shapes, dtypes, attrs):
    x = shapes[0]
    if not x:
        raise ValueError("rmsnorm needs rank >= 1")
    if len(shapes) == 2 and shapes[1] != (x[-1],):
        raise ValueError(f"rmsnorm weight must have shape [{x[-1]}], got {list(shapes[1])}")
    return x, _same_dtype("rmsnorm", dtypes)


def _infer_transpose(shapes, dtypes, attrs):
    (s,) = shapes
    if len(s) < 2:
        raise ValueError(f"transpose needs rank >= 2, got shape {list(s)}")
    return (*s[:-2], s[-1], s[-2]), dtypes[0]


def _elementwise(k: float):
    return lambda shapes, out, attrs: k * numel(out)


register(
    OpSpec(
        "matmul", 2, 2, _infer_matmul, flops=_flops_matmul, doc="a [.., m, k] @ b [.., k, n] -> [.., m, n]"
    )
)
register(
    OpSpec(
        "add",
        1,
        None,
        _infer_same_shape("add"),
        flops=lambda s, o, a: (len(s) - 1) * numel(o),
        doc="elementwise sum of 1 or more tensors of one shape",
    )
)
register(
    OpSpec("mul", 2, 2, _infer_same_shape("mul"), flops=_elementwise(1), doc="elementwise product a * b")
)
register(
    OpSpec(
        "scale",
        1,
        1,
        _infer_unary_float("scale"),
        attrs={"factor": REQUIRED},
        flops=_elementwise(1),
        doc="x * factor",
    )
)
register(
    OpSpec(
        "softmax",
        1,
        1,
        _infer_unary_float("softmax", 1),
        flops=_elementwise(5),
        doc="softmax over the last dim",
    )
)
register(OpSpec("silu", 1, 1, _infer_unary_float("silu"), flops=_elementwise(4), doc="x * sigmoid(x)"))
register(
    OpSpec(
        "rmsnorm",
        1,
        2,
        _infer_rmsnorm,
        attrs={"eps": 1e-6},
        flops=_elementwise(4),
        doc="x / sqrt(mean(x^2, last dim) + eps) [* w]",
    )
)
register(OpSpec("transpose", 1, 1, _infer_transpose, flops=lambda s, o, a: 0.0, doc="swap the last two dims"))


# ---- ops for the workloads (matmul chain, LLaMA prefill) -------------------------------------
def _infer_concat(shapes, dtypes, attrs):
    rank = len(shapes[0])
    axis = attrs["axis"]
    if not -rank <= axis < rank:
        raise ValueError(f"concat axis {axis} out of range for rank {rank}")
    axis %= rank
    for s in shapes[1:]:
        if len(s) != rank or any(a != b for d, (a, b) in enumerate(zip(s, shapes[0])) if d != axis):
            raise ValueError(f"concat operands {[list(x) for x in shapes]} differ off axis {axis}")
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    return tuple(out), _same_dtype("concat", dtypes, floats=False)


def _infer_rope(shapes, dtypes, attrs):
    x, cos, sin = shapes
    if len(x) < 2 or len(cos) != 2 or cos != sin:
        raise ValueError(f"rope needs x [.., s, h*d] and cos, sin [s, d], got {[list(s) for s in shapes]}")
    s, d = cos
    if d % 2 or x[-2] != s or x[-1] % d:
        raise ValueError(f"rope: x {list(x)} does not fit cos/sin {[s, d]} (even d dividing the last dim)")
    return x, _same_dtype("rope", dtypes)


def _flops_rope(shapes, out, attrs):
    return 3.0 * numel(out)


def _infer_attention(shapes, dtypes, attrs):
    if len(shapes) % 2 == 0:
        raise ValueError(f"attention takes q and pairs of key/value tiles, got {len(shapes)} operands")
    q, kv = shapes[0], shapes[1:]
    m = len(kv) // 2
    h = attrs["heads"]
    if len(q) != 2 or not isinstance(h, int) or h < 1 or q[1] % h:
        raise ValueError(f"attention: q must be [t, heads*d] with heads={h} dividing it, got {list(q)}")
    for j in range(m):
        k, v = kv[j], kv[m + j]
        if len(k) != 2 or k[1] != q[1] or v != k:
            raise ValueError(f"attention: key/value tile {j} {list(k)}/{list(v)} does not match q {list(q)}")
    return q, _same_dtype("attention", dtypes)


def attention_pairs(t: int, keys: int, offset: int, causal: bool) -> int:
    """Number of (query row, key) pairs an attention tile scores: query row r sees keys <= offset + r."""
    if not causal:
        return t * keys
    first = min(keys, max(0, offset + 1))  # keys row 0 sees
    cut = max(0, min(t, keys - first))  # rows whose window the mask cuts short
    return cut * first + cut * (cut - 1) // 2 + (t - cut) * keys


def _flops_attention(shapes, out, attrs):
    q = shapes[0]
    keys = sum(s[0] for s in shapes[1 : 1 + len(shapes) // 2])
    d = q[1] // attrs["heads"]
    pairs = attention_pairs(q[0], keys, attrs["offset"], attrs["causal"]) * attrs["heads"]
    return pairs * (4.0 * d + 5.0)  # q k^T and p v (2 flops per multiply-add each), softmax


register(
    OpSpec(
        "concat",
        1,
        None,
        _infer_concat,
        attrs={"axis": -1},
        flops=lambda s, o, a: 0.0,
        doc="operands of one shape but along `axis` joined along it",
    )
)
register(
    OpSpec(
        "rope",
        3,
        3,
        _infer_rope,
        flops=_flops_rope,
        doc="rotary embedding of x [.., s, heads*d] per head (rotate-half form): x*cos + rot(x)*sin, "
        "cos and sin [s, d]",
    )
)
register(
    OpSpec(
        "attention",
        3,
        None,
        _infer_attention,
        attrs={"heads": REQUIRED, "scale": REQUIRED, "offset": 0, "causal": True},
        flops=_flops_attention,
        doc="one query tile of multi-head attention: operands q [t, heads*d], key tiles k_1..k_m, then "
        "value tiles v_1..v_m (each [t_j, heads*d], keys in order); softmax(q k^T * scale + mask) v "
        "per head, where query row r may see key rows <= offset + r when causal",
    )
)
