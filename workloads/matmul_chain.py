"""The papers' running example (DISCO §1, Figures 1-3): X(i+1) = X(i) x Y(i), tensor-parallel.

Y(i) is split into G column blocks; GPU j computes X(i) x Y(i)_j, sends its block to every other
GPU, and each GPU concatenates the G blocks into the full X(i+1) for the next level. Every Y(i)_j
is a graph input (it starts on the host), declared at the start of its level so that the planner's
serial order (insertion order) loads it just before it is used.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from disco_ray.graph.dtypes import torch_dtype
from disco_ray.graph.errors import UsageError
from disco_ray.graph.taskgraph import TaskGraph

from . import Workload


def matmul_chain(
    n: int = 4,  # levels
    gpus: int = 2,
    tokens: int = 64,  # rows of X
    hidden: int = 128,  # X is [tokens, hidden], Y(i) [hidden, hidden]
    dtype: str = "float32",
    seed: int = 0,
    materialize: bool = True,  # False: no input tensors (for planning and simulation only)
) -> Workload:
    """Builds the n-level tensor-parallel matmul chain over `gpus` GPUs."""
    if n < 1 or gpus < 1 or tokens < 1 or hidden < 1:
        raise UsageError(
            f"matmul_chain needs positive n, gpus, tokens, hidden; got {n}, {gpus}, {tokens}, {hidden}"
        )
    if hidden % gpus:
        raise UsageError(f"matmul_chain: hidden {hidden} is not divisible by gpus {gpus}")
    g = TaskGraph(gpus)
    block = hidden // gpus
    levels: list[list[str]] = [[] for _ in range(n)]
    weights: list[str] = []
    # X(0) is one input per GPU (the same values), as each GPU needs all of it
    x = [g.input(f"x0_g{j}", (tokens, hidden), dtype, gpu=j) for j in range(gpus)]
    levels[0] += x
    for i in range(n):
        ys = [g.input(f"y{i}_g{j}", (hidden, block), dtype, gpu=j) for j in range(gpus)]
        weights += ys
        parts = [g.matmul(x[j], ys[j], id=f"p{i}_g{j}") for j in range(gpus)]
        ids = [*ys, *parts]
        if gpus == 1:
            x = parts
        else:
            nxt = []
            for j in range(gpus):
                blocks = [
                    parts[j] if k == j else g.transfer(parts[k], j, id=f"t{i}_{k}to{j}") for k in range(gpus)
                ]
                ids += [b for k, b in enumerate(blocks) if k != j]
                nxt.append(g.kernel("concat", *blocks, gpu=j, id=f"x{i + 1}_g{j}", axis=-1))
            ids += nxt
            x = nxt
        levels[i] += ids
    g.output(x[0])
    inputs = _inputs(g, seed, hidden) if materialize else {}
    out_id = x[0]

    def reference(ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = ins["x0_g0"]
        for i in range(n):
            y = torch.cat([ins[f"y{i}_g{j}"] for j in range(gpus)], dim=1)
            h = h @ y
        return {out_id: h}

    return Workload(
        "matmul_chain",
        g,
        inputs,
        reference,
        levels,
        weights,
        dict(n=n, gpus=gpus, tokens=tokens, hidden=hidden, dtype=dtype, seed=seed),
    )


def _inputs(g: TaskGraph, seed: int, hidden: int) -> dict[str, torch.Tensor]:
    """Random inputs; weights scaled by 1/sqrt(hidden) so a long chain keeps values near 1."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    x0 = None
    for v in g.inputs():
        if v.id.startswith("x0_"):
            x0 = torch.randn(v.shape, generator=gen) if x0 is None else x0
            out[v.id] = x0.to(torch_dtype(v.dtype))
        else:
            out[v.id] = (torch.randn(v.shape, generator=gen) / hidden**0.5).to(torch_dtype(v.dtype))
    return out
