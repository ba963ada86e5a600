"""Plain torch evaluation of a TaskGraph: the ground truth every run is checked against."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from . import sources
from .dtypes import torch_dtype
from .errors import RunError
from .kernels import run_kernel
from .taskgraph import Kind, TaskGraph, Vertex


def check_inputs(
    tg: TaskGraph,
    inputs: Mapping[str, object],
    held: Collection[str] = (),
    callers: Sequence[Vertex] | None = None,
) -> None:
    """Refuses missing inputs and inputs of the wrong shape or dtype, naming the first one.

    Only the caller's inputs are asked for: an input with a source or a state is the worker's,
    and one in `held` the workers keep from an earlier run (it may be left out). `callers`:
    `tg.caller_inputs()`, when the caller keeps it (a Program runs its graph many times).
    """
    callers = tg.caller_inputs() if callers is None else callers
    for v in callers:
        if v.id not in inputs and v.id in held:
            continue
        if v.id not in inputs:
            raise RunError(f"input {v.id!r} is missing (shape {list(v.shape)}, {v.dtype})")
        t = inputs[v.id]
        shape = tuple(getattr(t, "shape", ()))
        dtype = str(getattr(t, "dtype", "")).removeprefix("torch.")
        if shape != v.shape:
            raise RunError(f"input {v.id!r} has shape {list(shape)}, the graph says {list(v.shape)}")
        if dtype != v.dtype:
            raise RunError(f"input {v.id!r} has dtype {dtype}, the graph says {v.dtype}")
    extra = set(inputs) - {v.id for v in callers}
    if extra:
        theirs = sorted(x for x in extra if x in tg and tg[x].kind is Kind.INPUT)
        if theirs:
            raise RunError(f"inputs {theirs} are read from their source or saved state, not handed in")
        raise RunError(f"inputs {sorted(extra)} are not inputs of the graph")


def evaluate(
    tg: TaskGraph,
    inputs: Mapping[str, torch.Tensor],
    device: str = "cpu",
    state: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Evaluates every vertex in order with the same kernels the runtime uses; returns the outputs.

    Inputs with a source are read from it; state inputs come from `state` (zeros if absent),
    and the carried values are saved into `state` afterwards, as a worker does.
    """
    check_inputs(tg, inputs)
    vals: dict[str, torch.Tensor] = {}
    for v in tg:
        if v.kind is Kind.INPUT and v.source is not None:
            vals[v.id] = sources.read(v.source, v.shape, v.dtype, f"input {v.id!r}").to(device)
        elif v.kind is Kind.INPUT and v.state:
            old = None if state is None else state.get(v.id)
            vals[v.id] = (torch.zeros(v.shape, dtype=torch_dtype(v.dtype)) if old is None else old).to(device)
        elif v.kind is Kind.INPUT:
            vals[v.id] = torch.as_tensor(inputs[v.id]).to(device)
        elif v.kind is Kind.TRANSFER:
            vals[v.id] = vals[v.inputs[0]].clone()
        else:
            assert v.op is not None  # a kernel vertex names its op
            out = torch.empty(v.shape, dtype=torch_dtype(v.dtype), device=device)
            run_kernel(v.op, out, [vals[i] for i in v.inputs], v.attrs)
            vals[v.id] = out
    if state is not None:
        state.update({key: vals[value].clone() for value, key in tg.carry.items()})
    return {o: vals[o] for o in tg.outputs}


def random_inputs(tg: TaskGraph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of the right shapes and dtypes with small values, so long chains stay finite."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for v in tg.caller_inputs():
        dt = torch_dtype(v.dtype)
        if dt.is_floating_point:
            out[v.id] = (torch.rand(v.shape, generator=gen) * 2 - 1).to(dt)
        else:
            out[v.id] = torch.randint(-4, 5, v.shape, generator=gen).to(dt)
    return out
