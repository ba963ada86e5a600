"""What an op is: `OpSpec` (arity, attributes, shape/dtype inference, FLOPs), the registry
`OPS` and `register`, and the inference helpers the op modules share (pure, no torch).

The ops themselves are registered by `disco_ray.graph.ops` (and the transformer ops it imports).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .dtypes import FLOATS, ITEMSIZE

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
            bad = check_attr(self.name, k, out[k], default)
            if bad:
                raise ValueError(f"op {self.name}: attribute {k} must be {bad}, got {out[k]!r}")
        return out


# ---- attribute types: checked when a graph is built or read, so no kernel ever sees a bad one ----
def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _ints(x: object) -> bool:
    return isinstance(x, (list, tuple)) and all(_is_int(d) for d in x)


# attribute name -> (test, what it must be) for the built-in ops' attributes; (op, name) first.
# The optimizer steps' lr, betas and weight decay are range-checked by their own inference.
ATTR_TYPES: dict[object, tuple[Callable[[Any], bool], str]] = {
    "axis": (_is_int, "an integer"),
    "start": (_is_int, "an integer"),
    "stop": (_is_int, "an integer"),
    "offset": (_is_int, "an integer"),
    ("rmsnorm", "offset"): (_is_real, "a finite number"),  # the norm's weight offset (Gemma: 1)
    ("rmsnorm_grad", "offset"): (_is_real, "a finite number"),
    "q_offset": (_is_int, "an integer"),
    "k_offset": (_is_int, "an integer"),
    "window": (lambda x: _is_int(x) and x >= 0, "an integer >= 0"),
    "heads": (lambda x: _is_int(x) and x >= 1, "an integer >= 1"),
    "rows": (lambda x: _is_int(x) and x >= 1, "an integer >= 1"),
    "kv_heads": (lambda x: x is None or (_is_int(x) and x >= 1), "null or an integer >= 1"),
    "scale": (_is_real, "a finite number"),
    ("sdpa", "scale"): (lambda x: x is None or _is_real(x), "null or a finite number"),
    "factor": (_is_real, "a finite number"),
    "value": (_is_real, "a finite number"),
    "eps": (lambda x: _is_real(x) and x >= 0, "a finite number >= 0"),
    "causal": (lambda x: isinstance(x, bool), "true or false"),
    "keepdim": (lambda x: isinstance(x, bool), "true or false"),
    "inverse": (lambda x: isinstance(x, bool), "true or false"),
    "approximate": (lambda x: x in ("none", "tanh"), '"none" or "tanh"'),
    "dtype": (lambda x: isinstance(x, str) and x in ITEMSIZE, f"one of {', '.join(ITEMSIZE)}"),
    "axes": (_ints, "a list of integers"),
    "dims": (_ints, "a list of integers"),
    "shape": (lambda x: _ints(x) and all(d >= 1 for d in x), "a list of positive integers"),
}
BUILTIN: set[str] = set()  # the ops ATTR_TYPES describes (an op of one's own may reuse a name)


def check_attr(op: str, name: str, value: object, default: object) -> str | None:
    """What attribute `name` of `op` must be when `value` is not that, else None. A built-in op's
    attribute follows ATTR_TYPES; an op of one's own's, the type of its default."""
    rule = ATTR_TYPES.get((op, name)) or ATTR_TYPES.get(name) if op in BUILTIN else None
    if rule is None:
        if isinstance(default, bool):
            rule = (lambda x: isinstance(x, bool), "true or false")
        elif isinstance(default, int):
            rule = (_is_int, "an integer")
        elif isinstance(default, float):
            rule = (_is_real, "a finite number")
        else:
            return None
    test, want = rule
    return None if test(value) else want


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


# FLOP counts (`OpSpec.flops`) that several ops share
def elementwise(k: float) -> Callable[[list[Shape], Shape, Mapping[str, Any]], float]:
    """`k` operations per output element."""
    return lambda shapes, out, attrs: k * numel(out)


def no_flops(shapes: list[Shape], out: Shape, attrs: Mapping[str, Any]) -> float:
    """None: the op moves or selects data."""
    return 0.0


def sum_flops(shapes: list[Shape], out: Shape, attrs: Mapping[str, Any]) -> float:
    """An n-ary sum: n - 1 additions per output element."""
    return (len(shapes) - 1) * numel(out)


def reduce_flops(shapes: list[Shape], out: Shape, attrs: Mapping[str, Any]) -> float:
    """A reduction: one operation per element of the first operand."""
    return float(numel(shapes[0]))


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
