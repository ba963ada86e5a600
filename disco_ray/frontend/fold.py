"""Constant folding: the ops of a captured program that depend on no input of the call run once,
in torch, while the graph is built.

What a model computes from shapes and buffers alone (position ids from `arange`, a causal mask
from comparisons of positions, rotary tables from `inv_freq`, the zeros a padding mask is
written into) is the same on every call: it runs eagerly here, with the very aten op the module
runs, so the result is exact, and it becomes a `Const`. A Const feeds further folding; an op
that also reads a value of the call gets it as a graph input (a constant, handed in once and
kept by the workers, as a weight). Parameters are never folded: a linear layer's weight stays a
weight the split can cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from disco_ray.graph.dtypes import from_torch
from disco_ray.graph.errors import FrontendError

from .values import Value

# ops whose result depends on the shape and dtype of their tensor operands, not on their values
SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full"})


@dataclass(eq=False, slots=True)
class Const:
    """A tensor known while the graph is built: a buffer, a lifted constant, or a folded result."""

    tensor: torch.Tensor
    name: str  # the name of its graph input
    weight: str | None = None  # the module's buffer or constant of that name, when it is one
    value: Value | None = None  # the graph input made of it, once an op reads it with a call's value

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


def op_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    return str(getattr(packet, "__name__", None) or getattr(target, "__name__", target))


def foldable(target, args, kwargs) -> bool:
    """Whether a node of `target` on these (mapped) arguments can run now: none of its operands
    is a value of the call (or only their shapes matter), and it draws no random numbers."""
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    leaves = pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, (Const, Value)))
    return not any(isinstance(x, Value) for x in leaves) or op_name(target) in SHAPE_ONLY


def evaluate(target, args, kwargs, stem: str):
    """Runs `target` eagerly on the CPU (a Value stands in as zeros of its shape: only shape-only
    ops see one); tensors in the result become Consts named after `stem`."""

    def real(x):
        if isinstance(x, Const):
            return x.tensor.clone() if mutates else x.tensor
        if isinstance(x, Value):
            return torch.zeros(x.shape, dtype=getattr(torch, x.dtype))
        if isinstance(x, torch.device):
            return torch.device("cpu")  # a module captured on the meta device folds on the CPU
        return x

    schema = getattr(target, "_schema", None)
    mutates = bool(schema is not None and schema.is_mutable)  # an in-place op: keep the operand intact
    a, kw = pytree.tree_map(real, (args, kwargs), is_leaf=lambda x: isinstance(x, (Const, Value)))
    with torch.no_grad():
        got = target(*a, **kw)
    flat, spec = pytree.tree_flatten(got)
    many = len(flat) > 1
    out = [
        Const(t, f"{stem}.{k}" if many else stem) if isinstance(t, torch.Tensor) else t
        for k, t in enumerate(flat)
    ]
    return pytree.tree_unflatten(out, spec)


def as_value(cx, c: Const) -> Value:
    """The graph input holding `c` (made once): its buffer's own input, or a new constant."""
    if c.value is None:
        t = c.tensor.detach()
        name = c.weight if c.weight is not None else cx.g.weights.constant(c.name, t)
        try:
            dtype = from_torch(t.dtype)
        except ValueError as e:
            raise FrontendError(f"constant {c.name!r} computed at capture: {e}") from None
        shape = tuple(int(d) for d in t.shape)
        c.value = Value(shape, dtype, name, weight=name)
    return c.value


def as_values(cx, tree, keep_empty: bool = False):
    """`tree` with every Const in it replaced by its graph input; an empty one (no graph value
    has a 0 dim) stays a Const when `keep_empty` (for a concatenation to drop), else ValueError."""

    def one(x):
        if not isinstance(x, Const):
            return x
        if x.tensor.numel() == 0:
            if keep_empty:
                return x
            raise ValueError(f"reads an empty tensor {list(x.shape)} ({x.name})")
        return as_value(cx, x)

    return pytree.tree_map(one, tree, is_leaf=lambda x: isinstance(x, Const))
