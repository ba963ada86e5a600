"""Binding a captured module's parameters, buffers and constants to TaskGraph inputs, by name.

Each weight becomes a graph input on the GPU that uses it: whole, or the block of rows or columns
a tensor-parallel split gives that GPU. Its values come from one of two places:

- tensors (the module's own `state_dict`, or a mapping the caller gives): the run hands each
  input in (its block sliced out once); the workers keep it across runs, so it crosses Ray once;
- safetensors files (one file, or a directory of them): each input names its block as a `source`
  (`disco_ray.graph.sources`), and the worker that uses it reads only that block, once, from the
  memory-mapped file. The module may then live on the meta device: no weight is ever in the
  driver's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from disco_ray.graph.dtypes import from_torch
from disco_ray.graph.errors import FrontendError
from disco_ray.graph.sources import Source
from disco_ray.graph.taskgraph import TaskGraph

Range = tuple[int, int] | None


def index_safetensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (file, shape) of a .safetensors file or of every one in a directory (headers only)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FrontendError(f"weights {path}: no .safetensors file there")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    out[key] = (str(f), tuple(h.get_slice(key).get_shape()))
        except (OSError, SafetensorError) as e:
            raise FrontendError(f"weights {f}: not a readable safetensors file ({e})") from None
    return out


class Weights:
    """The weights of one captured module: where each is read from, and the inputs made of them.

    Args:
        declared: name -> (shape, dtype) of every weight the graph may use (the exported program's).
        tensors: name -> tensor (a state_dict; also constants of the program).
        files: a safetensors file or directory; its tensors take precedence over `tensors`.
    """

    def __init__(
        self,
        declared: Mapping[str, tuple[tuple[int, ...], str]],
        tensors: Mapping[str, torch.Tensor],
        files: str | Path | None = None,
    ):
        self.declared = dict(declared)
        self.tensors = dict(tensors)
        self.index = index_safetensors(files) if files is not None else {}
        self.handed: dict[str, tuple[str, Range, Range]] = {}  # input id -> (weight, rows, cols)
        self._made: dict[tuple, str] = {}
        for name, (shape, _) in self.declared.items():
            self._check(name, shape)

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name in self.index:
            got = self.index[name][1]
            where = self.index[name][0]
        elif name in self.tensors:
            t = self.tensors[name]
            if t.device.type == "meta":
                raise FrontendError(
                    f"weight {name!r} is on the meta device: pass weights='model.safetensors' (or a "
                    "state_dict) to read its values from"
                )
            got, where = tuple(t.shape), "the given tensors"
        else:
            raise FrontendError(f"weight {name!r} ({list(shape)}) is in none of the weights given")
        if got != shape:
            raise FrontendError(f"weight {name!r} is {list(got)} in {where}, the module's is {list(shape)}")

    def known(self, name: str) -> torch.Tensor | None:
        """The value of weight `name` when the driver holds it (given as a tensor, not on the meta
        device, not read from files by the workers), else None."""
        t = self.tensors.get(name)
        return None if t is None or name in self.index or t.device.type == "meta" else t.detach()

    def constant(self, name: str, tensor: torch.Tensor) -> str:
        """Declares `tensor`, computed while capturing, as a weight; returns the name given it
        (`name`, or `name~2`, ... when the module has a weight of that name)."""
        got, n = name, 1
        while got in self.declared:
            n += 1
            got = f"{name}~{n}"
        self.declared[got] = declared_of(tensor)
        self.tensors[got] = tensor
        return got

    def input(
        self,
        tg: TaskGraph,
        name: str,
        gpu: int,
        fresh: Callable[[str], str],
        rows: Range = None,
        cols: Range = None,
    ) -> str:
        """The id of the graph input holding weight `name` (rows [a, b), columns [c, d)) on `gpu`."""
        key = (name, gpu, rows, cols)
        if key in self._made:
            return self._made[key]
        declared_shape, dtype = self.declared[name]
        shape = list(declared_shape)
        if rows is not None:
            shape[0] = rows[1] - rows[0]
        if cols is not None:
            shape[1] = cols[1] - cols[0]
        tag = "" if rows is None and cols is None else f"[{_rng(rows)}{',' + _rng(cols) if cols else ''}]"
        id = fresh(f"{name}{tag}" + (f"@g{gpu}" if gpu else ""))
        if name in self.index:
            slices = () if rows is None and cols is None else (rows, cols) if cols is not None else (rows,)
            tg.input(id, shape, dtype, gpu, source=Source(self.index[name][0], name, slices))
        else:
            tg.input(id, shape, dtype, gpu)
            self.handed[id] = (name, rows, cols)
        self._made[key] = id
        return id

    def values(self) -> dict[str, torch.Tensor]:
        """The tensors of the inputs a run hands in (each block contiguous, in the input's dtype)."""
        out = {}
        for id, (name, rows, cols) in self.handed.items():
            t = self.tensors[name].detach()
            if rows is not None:
                t = t[rows[0] : rows[1]]
            if cols is not None:
                t = t[:, cols[0] : cols[1]]
            out[id] = t.to(getattr(torch, self.declared[name][1])).contiguous()
        return out


def _rng(r: Range) -> str:
    return ":" if r is None else f"{r[0]}:{r[1]}"


def declared_of(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape), from_torch(t.dtype)
