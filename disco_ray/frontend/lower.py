"""Lowering captured ATen graphs to one TaskGraph, split over the GPUs.

Two ways to split (`split=`):

- "tensor" (Megatron-style, the default on more than one GPU): every linear layer whose weight is
  a parameter is tensor-parallel. A layer whose input is whole is split by output features
  (column-parallel: each GPU gets the input and its rows of the weight and bias, and holds its
  columns of the output); a layer whose input is such a column split is split by input features
  (row-parallel: each GPU multiplies its columns by its block of the weight, and the partial sums
  are added where the next op needs the whole). Elementwise ops between the two run on the
  parts (relu, gelu, ...), so an MLP's hidden layer never leaves its GPUs. Other ops run on GPU
  0. So the weights of the linear layers, most of a model's bytes, are spread evenly.
- "layers" (a pipeline by layer): the ops are cut, in their order, into `gpus` stages holding
  about equal weight bytes; each op runs on its stage's GPU and values cross a stage boundary by
  transfer.

Every op of a block that reads a value of the call is mapped by `aten.lookup` (the built-in
handlers of `aten`, `aten_hf` and `aten_cnn`, and those `register_aten` added); one on constants
alone is run at capture (`fold`). Ops with no mapping are refused before the walk by one
FrontendError naming all of them, each with its count and its first node, submodule and line of code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind

from disco_ray.graph.dtypes import from_torch
from disco_ray.graph.errors import FrontendError

from . import (
    aten,
    aten_cnn,  # noqa: F401 (registers its handlers into aten.ATEN)
    aten_hf,  # noqa: F401 (registers its handlers into aten.ATEN)
    fold,
)
from .capture import Block
from .values import Graph, Part, Value
from .weights import Weights

SPLITS = ("tensor", "layers")


@dataclass(frozen=True, slots=True)
class Lowered:
    """The TaskGraph of a module with what running it needs: which graph input each of the
    module's tensor inputs is, and which vertices hold each output (parts to concatenate)."""

    graph: Graph
    inputs: list[tuple[str, str | None, object]]  # (name, graph input id or None, example value)
    outputs: list[tuple[str, list[str]]]  # (output name, ids of its parts along the last axis)


def weight_targets(block: Block) -> dict[str, str]:
    """Placeholder name -> the module-wide name of the parameter, buffer or constant it holds."""
    sig = block.program.graph_signature
    out = {k: block.weight_name(v) for k, v in {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items()}
    # a lifted constant has no name in the module: the block's tag keeps blocks' constants apart
    out.update({k: f"{block.tag}{v}" for k, v in sig.inputs_to_lifted_tensor_constants.items()})
    return out


def declared_weights(blocks: Sequence[Block]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Module-wide weight name -> (shape, dtype), over every block."""
    out = {}
    for b in blocks:
        names = weight_targets(b)
        for node in b.program.graph.nodes:
            if node.op == "placeholder" and node.name in names:
                t = node.meta["val"]
                out[names[node.name]] = (tuple(int(d) for d in t.shape), from_torch(t.dtype))
    return out


def _stages(blocks: Sequence[Block], gpus: int) -> dict[tuple[int, str], int]:
    """(block, node) -> GPU: consecutive ops with about 1/gpus of the weight bytes each."""
    uses: list[tuple[tuple[int, str], int]] = []
    for i, b in enumerate(blocks):
        names = weight_targets(b)
        seen: set[str] = set()
        for node in b.program.graph.nodes:
            if node.op != "call_function":
                continue
            new = 0
            for a in node.all_input_nodes:
                if a.name in names and a.name not in seen:
                    seen.add(a.name)
                    new += a.meta["val"].numel() * a.meta["val"].element_size()
            uses.append(((i, node.name), new))
    total = sum(n for _, n in uses) or 1
    out, before = {}, 0
    for key, n in uses:
        out[key] = min(gpus - 1, int(gpus * (before + n / 2) / total))
        before += n
    return out


class Lowering:
    """The state handlers in `aten` work with: the graph, the node being mapped, its GPU."""

    def __init__(self, blocks: Sequence[Block], gpus: int, split: str, weights: Weights):
        if split not in SPLITS:
            raise FrontendError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.blocks, self.gpus, self.split = blocks, gpus, split
        self.g = Graph(gpus, weights)
        self.stage = _stages(blocks, gpus) if split == "layers" and gpus > 1 else {}
        self.node: torch.fx.Node | None = None
        self.params: set[str] = set()  # the placeholders of the block's parameters (never folded)
        self.gpu = 0
        self.stem = ""

    # ---- what handlers call -------------------------------------------------------------------
    def meta(self) -> tuple[tuple[int, ...], str]:
        """Shape and dtype torch gives the current node's (first) result."""
        assert self.node is not None
        t = self.node.meta["val"]
        t = t[0] if isinstance(t, (list, tuple)) else t
        return tuple(int(d) for d in t.shape), from_torch(t.dtype)

    def op(self, name: str, *vals: Value, **attrs) -> Value:
        """Kernel `name` on the current GPU over `vals` made whole there."""
        ids = [self.g.on(v, self.gpu) for v in vals]
        return self.g.whole(self.g.kernel(name, *ids, gpu=self.gpu, stem=self.stem, **attrs), self.gpu)

    def unary(self, name: str, v: Value, **attrs) -> Value:
        """An elementwise op: on each part where `v` is split, else on the whole."""
        if not v.split:
            return self.op(name, v, **attrs)
        parts = tuple(
            Part(
                p.gpu, self.g.kernel(name, p.id, gpu=p.gpu, stem=f"{self.stem}@g{p.gpu}", **attrs), p.lo, p.hi
            )
            for p in v.parts
        )
        shape, dtype = self.meta()
        return Value(shape, dtype, self.stem, parts=parts, axis=v.axis)

    def add(self, a: Value, b: Value) -> Value:
        """a + b: per part when both are split alike; into one summand when a is a partial sum
        and b has its shape (a residual after a row-parallel layer); else on the whole."""
        shape, dtype = self.meta()
        if (
            a.split
            and b.split
            and a.axis == b.axis
            and [(p.gpu, p.lo, p.hi) for p in a.parts] == [(p.gpu, p.lo, p.hi) for p in b.parts]
        ):
            parts = tuple(
                Part(
                    p.gpu,
                    self.g.kernel("add", p.id, q.id, gpu=p.gpu, stem=f"{self.stem}@g{p.gpu}"),
                    p.lo,
                    p.hi,
                )
                for p, q in zip(a.parts, b.parts)
            )
            return Value(shape, dtype, self.stem, parts=parts, axis=a.axis)
        for x, y in ((a, b), (b, a)):
            if x.summed and not y.summed and not y.split and x.shape == shape:
                g0, first = x.partial[0]
                s = self.g.kernel("add", first, self.g.on(y, g0), gpu=g0, stem=f"{self.stem}@g{g0}")
                return Value(shape, dtype, self.stem, partial=((g0, s), *x.partial[1:]))
        return self.op("add", a, b)

    def linear(self, x: Value, w: Value, b: Value | None) -> Value:
        """A linear layer, tensor-parallel where the split and the weight allow (module docstring)."""
        shape, dtype = self.meta()
        tp = self.split == "tensor" and self.gpus > 1 and w.weight is not None and len(w.shape) == 2
        if b is not None and b.weight is None:
            tp = False
        if not tp:
            return self.op("linear", x, w, *([b] if b is not None else []))
        assert w.weight is not None
        n_out, n_in = w.shape
        ws, fresh, tg = self.g.weights, self.g.fresh, self.g.tg
        if x.last_split and [(p.lo, p.hi) for p in x.parts] == _tiles(n_in, len(x.parts)):
            summands = []
            for k, p in enumerate(x.parts):  # row-parallel: the bias joins one summand
                ins = [p.id, ws.input(tg, w.weight, p.gpu, fresh, cols=(p.lo, p.hi))]
                if k == 0 and b is not None:
                    ins.append(self.g.on(b, p.gpu))
                summands.append(
                    (p.gpu, self.g.kernel("linear", *ins, gpu=p.gpu, stem=f"{self.stem}@g{p.gpu}"))
                )
            return Value(shape, dtype, self.stem, partial=tuple(summands))
        if n_out < self.gpus:
            return self.op("linear", x, w, *([b] if b is not None else []))
        parts = []
        for j, (lo, hi) in enumerate(_tiles(n_out, self.gpus)):  # column-parallel
            ins = [self.g.on(x, j), ws.input(tg, w.weight, j, fresh, rows=(lo, hi))]
            if b is not None:
                assert b.weight is not None
                ins.append(ws.input(tg, b.weight, j, fresh, rows=(lo, hi)))
            parts.append(Part(j, self.g.kernel("linear", *ins, gpu=j, stem=f"{self.stem}@g{j}"), lo, hi))
        return Value(shape, dtype, self.stem, parts=tuple(parts))

    # ---- the walk -----------------------------------------------------------------------------
    def run(self, example: Sequence[object]) -> Lowered:
        """Maps every block in order, the outputs of one feeding the next."""
        missing(self.blocks, self.g.weights)
        inputs: list[tuple[str, str | None, object]] = []
        carried: list[object] = []
        outs: list[object] = []
        for i, blk in enumerate(self.blocks):
            sig = blk.program.graph_signature
            # a non-tensor argument's placeholder is named by its spec (user_inputs holds its value)
            user = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
            names = weight_targets(blk)
            self.params = set(sig.inputs_to_parameters)
            env: dict[str, object] = {}
            for node in blk.program.graph.nodes:
                self.node, self.stem = node, f"{blk.tag}{node.name}"
                self.gpu = self.stage.get((i, node.name), 0)
                if node.op == "placeholder":
                    env[node.name] = self._placeholder(node, names, user, i, example, carried, inputs)
                elif node.op == "call_function":
                    env[node.name] = self._call(node, env)
                elif node.op == "output":
                    outs = [_mapped(a, env) for a in node.args[0]]
                else:
                    raise FrontendError(
                        f"node {node.name}: {node.op} nodes are not supported ({node.format_node()})"
                    )
            carried = outs
        return Lowered(self.g, inputs, self._outputs(outs))

    def _placeholder(self, node, names, user, block, example, carried, inputs):
        val = node.meta.get("val")
        if node.name in names:
            name = names[node.name]
            known = self.g.weights.known(name)
            if known is not None and node.name not in self.params:  # a buffer or constant: foldable
                return fold.Const(known, name, weight=name)
            shape, dtype = tuple(int(d) for d in val.shape), from_torch(val.dtype)
            return Value(shape, dtype, name, weight=name)
        k = user.index(node.name)
        if block > 0:
            return carried[k]
        if not isinstance(val, torch.Tensor):
            inputs.append((node.name, None, example[k]))  # a constant the capture specialised on
            return example[k]
        shape, dtype = tuple(int(d) for d in val.shape), from_torch(val.dtype)
        id = self.g.tg.input(self.g.fresh(node.name), shape, dtype, gpu=0)
        inputs.append((node.name, id, None))
        return self.g.whole(id, 0)

    def _call(self, node, env):
        key = getattr(getattr(node.target, "overloadpacket", None), "__name__", None) or getattr(
            node.target, "__name__", str(node.target)
        )
        args = [_mapped(a, env) for a in node.args]
        kwargs = {k: _mapped(a, env) for k, a in node.kwargs.items()}
        if fold.foldable(node.target, args, kwargs):  # no value of the call in it: run it now
            return fold.evaluate(node.target, args, kwargs, self.stem)
        try:
            args, kwargs = fold.as_values(self, (args, kwargs), keep_empty=key in ("cat", "concat"))
        except ValueError as e:
            raise FrontendError(f"{_where(node)}: aten op {node.target} {e}{_code(node)}") from None
        fn = aten.lookup(node.target)
        if fn is None:  # `missing` names every such op before the walk: one it judged foldable
            raise FrontendError(f"{_where(node)}: aten op {node.target} is not supported{_code(node)}")
        try:
            got = fn(self, *args, **kwargs)
        except aten.Unsupported as e:
            raise FrontendError(f"{_where(node)}: aten op {node.target} {e}{_code(node)}") from None
        for v in got if isinstance(got, tuple) else (got,):
            if (
                isinstance(v, Value)
                and not isinstance(node.meta["val"], (list, tuple))
                and (v.shape, v.dtype) != self.meta()
            ):
                raise FrontendError(
                    f"{_where(node)}: internal: mapped to {list(v.shape)} {v.dtype}, torch gives "
                    f"{list(self.meta()[0])} {self.meta()[1]}"
                )
        return got

    def _outputs(self, outs: list[object]) -> list[tuple[str, list[str]]]:
        spec = self.blocks[-1].program.call_spec.out_spec
        names = output_names(spec, len(outs))
        res = []
        for name, v in zip(names, outs):
            if isinstance(v, fold.Const):
                v = fold.as_value(self, v)
            if not isinstance(v, Value):
                raise FrontendError(f"output {name!r} is not a tensor ({type(v).__name__})")
            ids = [p.id for p in v.parts] if v.last_split else [self.g.on(v, self.g.home(v))]
            for id in ids:
                if id not in self.g.tg.outputs:
                    self.g.tg.output(id)
            res.append((name, ids))
        return res


def missing(blocks: Sequence[Block], weights: Weights) -> None:
    """Refuses the graph when ops that read a value of the call have no mapping (one on constants
    alone folds, `fold.foldable`): one error naming all of them, each with its count and where it
    is first used."""
    found: dict[str, list] = {}  # op -> [count, first node]
    for i, blk in enumerate(blocks):
        live = _live(blk, weights, carried=i > 0)
        for node in blk.program.graph.nodes:
            if node.op == "call_function" and node.name in live and aten.lookup(node.target) is None:
                found.setdefault(str(node.target), [0, node])[0] += 1
    if not found:
        return
    each = "; ".join(
        f"{op} x{n} (first: {', '.join([_where(node), *_origin(node)])})"
        for op, (n, node) in sorted(found.items())
    )
    raise FrontendError(
        f"{len(found)} aten op(s) have no mapping: {each}. Map one onto an op of your own with "
        "disco_ray.frontend.register_aten (docs/FRONTEND.md#your-own-mapping)"
    )


def _live(blk: Block, weights: Weights, carried: bool) -> set[str]:
    """The nodes of `blk` the walk maps rather than folds: those reading, through any chain, a
    tensor argument or a parameter (a buffer or constant with a known value folds), unless the op
    reads only shapes; random ops always (as `fold.foldable` decides at the walk)."""
    sig = blk.program.graph_signature
    names = weight_targets(blk)
    live: set[str] = set()
    for node in blk.program.graph.nodes:
        if node.op == "placeholder":
            if node.name in names:
                fixed = (
                    weights.known(names[node.name]) is not None and node.name not in sig.inputs_to_parameters
                )
                if not fixed:
                    live.add(node.name)
            elif carried or isinstance(node.meta.get("val"), torch.Tensor):
                live.add(node.name)
        elif node.op == "call_function":
            reads = any(a.name in live for a in node.all_input_nodes)
            seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
            if seeded or (reads and fold.op_name(node.target) not in fold.SHAPE_ONLY):
                live.add(node.name)
    return live


def _tiles(n: int, k: int) -> list[tuple[int, int]]:
    """[0, n) cut into k near-equal ranges."""
    b = [round(j * n / k) for j in range(k + 1)]
    return [(b[j], b[j + 1]) for j in range(k)]


def _mapped(a, env):
    if isinstance(a, torch.fx.Node):
        return env[a.name]
    if isinstance(a, list):
        return [_mapped(x, env) for x in a]
    if isinstance(a, tuple):
        return tuple(_mapped(x, env) for x in a)
    return a


def _where(node) -> str:
    return f"node {node.name!r}"


def _code(node) -> str:
    """' (in MODULE: TYPE, at FILE:LINE: CODE)' from what torch recorded of the node's origin."""
    where = _origin(node)
    return f" ({', '.join(where)})" if where else ""


def _origin(node) -> list[str]:
    """['in MODULE: TYPE', 'at FILE:LINE: CODE'], what torch recorded of them."""
    where = []
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, typ = list(stack.values())[-1]
        typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
        where.append(f"in {path or 'the module'}: {typ.rsplit('.', 1)[-1]}")
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines() if ln.strip()]
    if len(lines) >= 2 and lines[-2].startswith("File "):
        where.append(f"at {lines[-2].removeprefix('File ')}: {lines[-1]}")
    return where


def output_names(spec, n: int) -> list[str]:
    """The names of a program's n flat outputs from its output pytree spec: 'output' for a lone
    tensor, the index in a tuple or list, the key in a dict, joined by '.' when nested."""
    from torch.utils import _pytree as pytree

    tree = pytree.tree_unflatten(list(range(n)), spec)
    flat, _ = pytree.tree_flatten_with_path(tree)
    out = []
    for path, _ in flat:
        parts = []
        for k in path:
            for attr in ("idx", "key", "name"):
                if hasattr(k, attr):
                    parts.append(str(getattr(k, attr)))
                    break
        out.append(".".join(parts) or "output")
    return out
