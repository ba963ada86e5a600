"""What an op is: `OpSpec` (arity, attributes, shape/dtype inference, FLOPs), the registry
`OPS` and `register`, and the inference helpers the op modules share (pure, no torch).

The ops themselves are registered by `disco_ray.graph.ops` (and the transformer ops it imports).
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
