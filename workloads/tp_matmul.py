"""One large X x Y split along k over G GPUs (the papers' Figure 2/3 decomposition).

GPU j holds X[:, k_j] and Y[k_j, :] (graph inputs) and computes the partial product
X[:, k_j] x Y[k_j, :]; the partials are transferred to GPU 0 and summed there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from disco_ray.graph.dtypes import torch_dtype
from disco_ray.graph.errors import UsageError
from disco_ray.graph.taskgraph import TaskGraph

from . import Workload


def tp_matmul(
    gpus: int = 2,
    m: int = 128,
    k: int = 128,  # the split dimension
    n: int = 128,
    dtype: str = "float32",
    seed: int = 0,
    materialize: bool = True,  # False: no input tensors (for planning and simulation only)
) -> Workload:
    """Builds X [m, k] x Y [k, n] with the k dimension split over `gpus` GPUs."""
    if min(gpus, m, k, n) < 1:
        raise UsageError(f"tp_matmul needs positive gpus, m, k, n; got {gpus}, {m}, {k}, {n}")
    if k % gpus:
        raise UsageError(f"tp_matmul: k {k} is not divisible by gpus {gpus}")
    g = TaskGraph(gpus)
    kb = k // gpus
    xs = [g.input(f"x_g{j}", (m, kb), dtype, gpu=j) for j in range(gpus)]
    ys = [g.input(f"y_g{j}", (kb, n), dtype, gpu=j) for j in range(gpus)]
    parts = [g.matmul(xs[j], ys[j], id=f"p_g{j}") for j in range(gpus)]
    moved = [parts[0]] + [g.transfer(parts[j], 0, id=f"t_{j}to0") for j in range(1, gpus)]
    out = g.add(*moved, id="z")
    g.output(out)
    inputs = {}
    if materialize:
        gen = torch.Generator().manual_seed(seed)
        for v in g.inputs():
            inputs[v.id] = (torch.randn(v.shape, generator=gen) / k**0.25).to(torch_dtype(v.dtype))

    def reference(ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = torch.cat([ins[f"x_g{j}"] for j in range(gpus)], dim=1)
        y = torch.cat([ins[f"y_g{j}"] for j in range(gpus)], dim=0)
        return {out: x @ y}

    return Workload(
        "tp_matmul",
        g,
        inputs,
        reference,
        [[*xs, *ys, *parts, *moved[1:], out]],
        ys,
        dict(gpus=gpus, m=m, k=k, n=n, dtype=dtype, seed=seed),
    )
