"""Plain torch evaluation of a TaskGraph: the ground truth every run is checked against."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .dtypes import torch_dtype
from .errors import RunError
from .kernels import run_kernel
from .taskgraph import Kind, TaskGraph


def check_inputs(tg: TaskGraph, inputs: Mapping[str, object]) -> None:
    """Refuses missing inputs and inputs of the wrong shape or dtype, naming the first one."""
    for v in tg.inputs():
        if v.id not in inputs:
            raise RunError(f"input {v.id!r} is missing (shape {list(v.shape)}, {v.dtype})")
        t = inputs[v.id]
        shape = tuple(getattr(t, "shape", ()))
        dtype = str(getattr(t, "dtype", "")).removeprefix("torch.")
        if shape != v.shape:
            raise RunError(f"input {v.id!r} has shape {list(shape)}, the graph says {list(v.shape)}")
        if dtype != v.dtype:
            raise RunError(f"input {v.id!r} has dtype {dtype}, the graph says {v.dtype}")
    extra = set(inputs) - {v.id for v in tg.inputs()}
    if extra:
        raise RunError(f"inputs {sorted(extra)} are not inputs of the graph")


def evaluate(
    tg: TaskGraph, inputs: Mapping[str, torch.Tensor], device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Evaluates every vertex in order with the same kernels the runtime uses; returns the outputs."""
    check_inputs(tg, inputs)
    vals: dict[str, torch.Tensor] = {}
    for v in tg:
        if v.kind is Kind.INPUT:
            vals[v.id] = torch.as_tensor(inputs[v.id]).to(device)
        elif v.kind is Kind.TRANSFER:
            vals[v.id] = vals[v.inputs[0]].clone()
        else:
            assert v.op is not None  # a kernel vertex names its op
            out = torch.empty(v.shape, dtype=torch_dtype(v.dtype), device=device)
            run_kernel(v.op, out, [vals[i] for i in v.inputs], v.attrs)
            vals[v.id] = out
    return {o: vals[o] for o in tg.outputs}


def random_inputs(tg: TaskGraph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of the right shapes and dtypes with small values, so long chains stay finite."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for v in tg.inputs():
        dt = torch_dtype(v.dtype)
        if dt.is_floating_point:
            out[v.id] = (torch.rand(v.shape, generator=gen) * 2 - 1).to(dt)
        else:
            out[v.id] = torch.randint(-4, 5, v.shape, generator=gen).to(dt)
    return out
