"""TaskGraph: the dataflow DAG a user hands in (FORMATS.md, "disco-taskgraph").

Vertices are graph inputs, kernel calls pinned to a GPU, and GPU-to-GPU transfers. The builder
checks every vertex as it is added, so a built graph is always valid; `from_dict` accepts
vertices in any order and checks the same things plus cycles and unknown inputs.

Additions to FORMATS.md (fields only; a reader that ignores them sees a valid version-1 graph):
- an input's `"source"` (`disco_ray.graph.sources.Source`): the worker reads the value itself
  from a safetensors file, once, and keeps it across runs; the caller does not supply it;
- an input's `"state": true`: the value is the worker's saved state of that id (zeros until a
  run saves it), kept on the worker across runs and graphs; the caller does not supply it;
- the graph's `"carry": {"value": "state id", ...}`: after a run, each value's final contents
  are saved as that state on the value's GPU (e.g. a KV cache block a later graph reads);
- a vertex's `"when": [{"value": flag, "index": n}, ...]` (`condition`): the vertex is
  conditional, computed (loaded, moved) in a run only when column n of some flag is non-zero in
  some row; otherwise it is skipped (docs/FORMATS.md, "Conditional vertices").
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import cast

from . import ops
from .builder import OpMethods
from .conditions import condition
from .dtypes import ITEMSIZE, nbytes
from .errors import FormatError, GraphError, check_header
from .sources import Source
from .taskgraph_doc import records, topo_ids

FORMAT = "disco-taskgraph"
VERSION = 1
MAX_TENSOR_BYTES = 1 << 48  # 256 TiB: far beyond any GPU or host, still exact in a float64


class Kind(str, Enum):
    INPUT = "input"
    KERNEL = "kernel"
    TRANSFER = "transfer"


@dataclass(frozen=True, slots=True, eq=True)
class Vertex:
    id: str
    kind: Kind
    gpu: int
    shape: tuple[int, ...]
    dtype: str
    inputs: tuple[str, ...] = ()
    op: str | None = None
    attrs: Mapping[str, object] = field(default_factory=dict)
    source: Source | None = None  # input: read by the worker from this file block
    state: bool = False  # input: the worker's saved state of this id
    # (flag value, column): skipped at run time unless some row of one flag's column is non-zero
    when: tuple[tuple[str, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    @property
    def from_caller(self) -> bool:
        """An input the caller hands in at every run (not read from a source, not a state)."""
        return self.kind is Kind.INPUT and self.source is None and not self.state

    def to_dict(self) -> dict:
        d: dict = {"id": self.id, "kind": self.kind.value, "gpu": self.gpu}
        if self.kind is Kind.KERNEL:
            d["op"] = self.op
        if self.kind is not Kind.INPUT:
            d["inputs"] = list(self.inputs)
        if self.attrs:
            d["attrs"] = dict(self.attrs)
        d["shape"] = list(self.shape)
        d["dtype"] = self.dtype
        if self.source is not None:
            d["source"] = self.source.to_dict()
        if self.state:
            d["state"] = True
        if self.when:
            d["when"] = [{"value": f, "index": n} for f, n in self.when]
        return d


class TaskGraph(OpMethods):
    """A dataflow DAG over `gpus` GPUs, built with `input`, op methods (`disco_ray.graph.builder`),
    `transfer` and `output`.

    >>> g = TaskGraph(gpus=2)
    >>> x = g.input("x", (64, 64), gpu=0); w = g.input("w", (64, 64), gpu=0)
    >>> y = g.matmul(x, w); z = g.transfer(y, gpu=1); g.output(z)
    """

    def __init__(self, gpus: int = 1):
        if not isinstance(gpus, int) or isinstance(gpus, bool) or not 1 <= gpus <= 65536:
            raise GraphError(f"gpus must be a positive integer (at most 65536), got {gpus!r}")
        self.gpus = gpus
        self.vertices: dict[str, Vertex] = {}  # insertion order is a topological order
        self.outputs: list[str] = []
        self.carry: dict[str, str] = {}  # value -> the state id its final contents are saved as
        self._auto = 0

    # ---- builder ---------------------------------------------------------------------------
    def input(
        self,
        id: str,
        shape: Sequence[int],
        dtype: str = "float32",
        gpu: int = 0,
        *,
        source: Source | None = None,
        state: bool = False,
    ) -> str:
        """A graph input: handed in by the caller, or read from `source`, or the saved `state`."""
        return self._add(id, Kind.INPUT, gpu, (), shape=shape, dtype=dtype, source=source, state=state)

    def kernel(self, op: str, *inputs: str, gpu: int | None = None, id: str | None = None, **attrs) -> str:
        """Adds a kernel call of `op`; `gpu` defaults to the first operand's GPU."""
        if gpu is None:
            gpu = self._gpu_of(inputs[0]) if inputs else 0
        return self._add(id or self._fresh(op), Kind.KERNEL, gpu, inputs, op=op, attrs=attrs)

    def transfer(self, x: str, gpu: int, id: str | None = None) -> str:
        return self._add(id or self._fresh("xfer"), Kind.TRANSFER, gpu, (x,))

    def output(self, *ids: str) -> None:
        for i in ids:
            if not isinstance(i, str) or i not in self.vertices:
                raise GraphError(f"output {i!r}: no such vertex")
            if i in self.outputs:
                raise GraphError(f"output {i!r} listed twice")
            self.outputs.append(i)

    def save_state(self, value: str, key: str) -> None:
        """After each run, saves `value`'s final contents as state `key` on its GPU (`carry`)."""
        v = self.vertices.get(value) if isinstance(value, str) else None
        if v is None:
            raise GraphError(f"carry {value!r}: no such vertex")
        if not isinstance(key, str) or not key:
            raise GraphError(f"carry {value!r}: the state id must be a non-empty string, got {key!r}")
        if value in self.carry:
            raise GraphError(f"carry {value!r}: already saved as state {self.carry[value]!r}")
        if key in self.carry.values():
            raise GraphError(f"carry {value!r}: state {key!r} is saved by another value too")
        s = self.vertices.get(key)
        if s is not None and s.state and (s.gpu, s.shape, s.dtype) != (v.gpu, v.shape, v.dtype):
            raise GraphError(
                f"carry {value!r}: state {key!r} is {list(s.shape)} {s.dtype} on gpu {s.gpu}, the value "
                f"{list(v.shape)} {v.dtype} on gpu {v.gpu}"
            )
        self.carry[value] = key

    def condition(self, id: str, flag: str, index: int) -> None:
        """Makes vertex `id` conditional on column `index` of `flag`
        (`disco_ray.graph.conditions.condition`)."""
        condition(self.vertices, id, flag, index)

    @property
    def conditional(self) -> bool:
        """Whether some vertex is conditional (`condition`)."""
        return any(v.when for v in self.vertices.values())

    # ---- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.vertices)

    def __iter__(self) -> Iterator[Vertex]:
        return iter(self.vertices.values())

    def __getitem__(self, id: str) -> Vertex:
        return self.vertices[id]

    def __contains__(self, id: object) -> bool:
        return id in self.vertices

    def inputs(self) -> list[Vertex]:
        return [v for v in self.vertices.values() if v.kind is Kind.INPUT]

    def caller_inputs(self) -> list[Vertex]:
        """The inputs a run must be handed (neither read from a source nor saved state)."""
        return [v for v in self.vertices.values() if v.from_caller]

    @property
    def kept(self) -> list[str]:
        """The values a plan must still hold at the end of a run: outputs, then carried values."""
        return list(dict.fromkeys([*self.outputs, *self.carry]))

    def consumers(self) -> dict[str, list[str]]:
        """For each vertex, the vertices that read it (once per distinct reader)."""
        out: dict[str, list[str]] = {i: [] for i in self.vertices}
        for v in self.vertices.values():
            for i in dict.fromkeys(v.inputs):
                out[i].append(v.id)
        return out

    def statistics(self) -> dict:
        kinds = {k.value: 0 for k in Kind}
        for v in self.vertices.values():
            kinds[v.kind.value] += 1
        per_gpu = [0] * self.gpus
        for v in self.vertices.values():
            per_gpu[v.gpu] += v.nbytes
        return {
            "vertices": len(self.vertices),
            "by_kind": kinds,
            "gpus": self.gpus,
            "outputs": len(self.outputs),
            "tensor_bytes_per_gpu": per_gpu,
            "input_bytes": sum(v.nbytes for v in self.inputs()),
            "sourced_inputs": sum(v.source is not None for v in self.inputs()),
            "state_inputs": sum(v.state for v in self.inputs()),
            "carried": len(self.carry),
        }

    # ---- checks ----------------------------------------------------------------------------
    def _fresh(self, stem: str) -> str:
        while True:
            self._auto += 1
            name = f"{stem}{self._auto}"
            if name not in self.vertices:
                return name

    def _gpu_of(self, id: str) -> int:
        if id not in self.vertices:
            raise GraphError(f"unknown input {id!r}")
        return self.vertices[id].gpu

    def _add(
        self,
        id,
        kind: Kind,
        gpu,
        inputs,
        *,
        op=None,
        attrs=None,
        shape=None,
        dtype=None,
        source=None,
        state=False,
    ) -> str:
        v = self._check(id, kind, gpu, tuple(inputs), op, attrs or {}, shape, dtype)
        if source is not None or state:
            where = f"vertex {id!r}"
            if kind is not Kind.INPUT:
                raise GraphError(f"{where}: only an input may have a source or be a state")
            if source is not None and not isinstance(source, Source):
                raise GraphError(f"{where}: source must be a Source, got {source!r}")
            if not isinstance(state, bool):
                raise GraphError(f"{where}: state must be true or false, got {state!r}")
            if source is not None and state:
                raise GraphError(f"{where}: an input is read from a source or is a state, not both")
            v = Vertex(v.id, v.kind, v.gpu, v.shape, v.dtype, source=source, state=state)
        self.vertices[id] = v
        return id

    def _check(self, id, kind, gpu, inputs, op, attrs, shape, dtype) -> Vertex:
        where = f"vertex {id!r}"
        if not isinstance(id, str) or not id:
            raise GraphError(f"vertex id must be a non-empty string, got {id!r}")
        if id in self.vertices:
            raise GraphError(f"{where}: duplicate id")
        if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < self.gpus:
            raise GraphError(f"{where}: gpu {gpu!r} out of range 0..{self.gpus - 1}")
        for i in inputs:
            if i not in self.vertices:
                raise GraphError(f"{where}: unknown input {i!r}")
        if shape is not None:
            try:
                if isinstance(shape, (str, bytes)) or any(isinstance(d, bool) for d in shape):
                    raise TypeError(shape)
                shape = tuple(operator.index(d) for d in shape)  # refuses 1.5, accepts numpy ints
            except (TypeError, ValueError):
                raise GraphError(f"{where}: shape must be a list of integers, got {shape!r}") from None
            if any(d < 1 for d in shape):
                raise GraphError(f"{where}: shape {list(shape)} has a dimension < 1 (no empty tensors)")
        if dtype is not None and (not isinstance(dtype, str) or dtype not in ITEMSIZE):
            raise GraphError(f"{where}: unknown dtype {dtype!r} (one of {', '.join(ITEMSIZE)})")
        if kind is Kind.INPUT:
            if inputs:
                raise GraphError(f"{where}: an input vertex has no inputs")
            if shape is None or dtype is None:
                raise GraphError(f"{where}: an input needs shape and dtype")
            _check_size(where, shape, dtype)
            return Vertex(id, kind, gpu, shape, dtype)
        ins = [self.vertices[i] for i in inputs]
        if kind is Kind.TRANSFER:
            if len(ins) != 1:
                raise GraphError(f"{where}: a transfer takes exactly 1 input, got {len(ins)}")
            if ins[0].gpu == gpu:
                raise GraphError(f"{where}: transfer of {ins[0].id!r} to gpu {gpu}, where it already is")
            out_shape, out_dtype = ins[0].shape, ins[0].dtype
        else:
            if not isinstance(op, str) or op not in ops.OPS:
                raise GraphError(
                    f"{where}: unknown op {op!r} (one of {', '.join(sorted(ops.OPS))}; an op of one's own "
                    'is registered before the graph is built or loaded: README, "Your own op")'
                )
            spec = ops.OPS[op]
            bad = spec.check_arity(len(ins))
            if bad:
                raise GraphError(f"{where}: {bad}")
            for x in ins:
                if x.gpu != gpu:
                    raise GraphError(
                        f"{where}: operand {x.id!r} is on gpu {x.gpu}, the kernel on gpu {gpu}"
                        " (add a transfer)"
                    )
            try:
                attrs = spec.full_attrs(attrs)
                out_shape, out_dtype = spec.infer([x.shape for x in ins], [x.dtype for x in ins], attrs)
            except ValueError as e:
                raise GraphError(f"{where}: {e}") from None
        _check_size(where, out_shape, out_dtype)
        if shape is not None and tuple(shape) != tuple(out_shape):
            raise GraphError(f"{where}: stated shape {list(shape)} but {kind.value} gives {list(out_shape)}")
        if dtype is not None and dtype != out_dtype:
            raise GraphError(f"{where}: stated dtype {dtype} but {kind.value} gives {out_dtype}")
        return Vertex(id, kind, gpu, tuple(out_shape), out_dtype, inputs, op, dict(attrs) if attrs else {})

    def validate(self) -> None:
        """Re-checks every vertex and output (a built graph is valid; this guards hand edits)."""
        rebuilt = TaskGraph.from_dict(self.to_dict())
        if rebuilt.vertices != self.vertices:
            raise GraphError("graph changed when re-validated")

    # ---- formats ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "format": FORMAT,
            "version": VERSION,
            "gpus": self.gpus,
            "vertices": [v.to_dict() for v in self.vertices.values()],
            "outputs": list(self.outputs),
        }
        if self.carry:
            d["carry"] = dict(self.carry)
        return d

    @classmethod
    def from_dict(cls, doc: object) -> TaskGraph:
        doc = check_header(doc, "taskgraph", FORMAT, VERSION)
        raw = doc.get("vertices")
        if not isinstance(raw, list):
            raise FormatError('taskgraph: "vertices" must be a list')
        g = cls(cast(int, doc.get("gpus")))  # __init__ checks it
        by_id = records(raw, {k.value for k in Kind})
        for vid in topo_ids(by_id):
            r = by_id[vid]
            g._add(
                vid,
                Kind(r["kind"]),
                r.get("gpu"),
                r.get("inputs", []),
                op=r.get("op"),
                attrs=r.get("attrs"),
                shape=r.get("shape"),
                dtype=r.get("dtype"),
                source=None if r.get("source") is None else Source.from_dict(r["source"], f"vertex {vid!r}"),
                state=bool(r.get("state", False)),
            )
        for vid, r in by_id.items():
            for c in r.get("when", []):
                g.condition(vid, c["value"], c.get("index"))
        outs = doc.get("outputs", [])
        if not isinstance(outs, list):
            raise FormatError('taskgraph: "outputs" must be a list of ids')
        g.output(*outs)
        carry = doc.get("carry", {})
        if not isinstance(carry, dict):
            raise FormatError('taskgraph: "carry" must be an object {value: state id}')
        for value, key in carry.items():
            g.save_state(value, key)
        return g


def _check_size(where: str, shape: Sequence[int], dtype: str) -> None:
    """Refuses an empty tensor (every dimension >= 1) and one of more than MAX_TENSOR_BYTES."""
    if any(d < 1 for d in shape):
        raise GraphError(f"{where}: shape {list(shape)} has a dimension < 1 (no empty tensors)")
    if nbytes(tuple(shape), dtype) > MAX_TENSOR_BYTES:
        raise GraphError(
            f"{where}: shape {list(shape)} {dtype} needs {nbytes(tuple(shape), dtype)} bytes, more than "
            f"the {MAX_TENSOR_BYTES} bytes any tensor may have"
        )
