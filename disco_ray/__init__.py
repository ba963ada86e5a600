"""disco-ray: run ML workloads larger than GPU memory on multi-GPU nodes with CPU-RAM offload, on Ray.

The public API, imported lazily (so `import disco_ray` pulls in neither torch nor ray):

    disco_ray.TaskGraph, disco_ray.MemGraph          the data model (disco_ray.graph)
    disco_ray.load_taskgraph, load_memgraph, save      TaskGraph/MemGraph files (.json, .msgpack)
    disco_ray.run, compile, run_memgraph, Program    plan and run (disco_ray.driver.api, .program)
    disco_ray.shutdown                               stop the shared Ray pool now (else at exit)
    disco_ray.from_torch, TorchModel                 a torch nn.Module as a TaskGraph (disco_ray.frontend)
    disco_ray.DiscoError, GraphError, RunError, ...  the error hierarchy (disco_ray.graph.errors)

The packages, in the direction imports flow: `disco_ray.graph` (data model) <- `planner`,
`actors`, `workloads` <- `disco_ray.driver` <- `disco_ray.bench`, `disco_ray.models`,
`disco_ray.frontend` <- `disco_ray.cli`.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_API = {
    "TaskGraph": "disco_ray.graph.taskgraph",
    "MemGraph": "disco_ray.graph.memgraph",
    "load_taskgraph": "disco_ray.graph.formats",
    "load_memgraph": "disco_ray.graph.formats",
    "save": "disco_ray.graph.formats",
    "run": "disco_ray.driver.api",
    "compile": "disco_ray.driver.api",
    "run_memgraph": "disco_ray.driver.api",
    "Program": "disco_ray.driver.program",
    "shutdown": "disco_ray.driver.pool",
    "models": "disco_ray.models",
    "from_torch": "disco_ray.frontend",
    "TorchModel": "disco_ray.frontend",
    "RunResult": "disco_ray.driver.program",
    **{
        e: "disco_ray.graph.errors"
        for e in (
            "DiscoError",
            "GraphError",
            "FormatError",
            "FrontendError",
            "CapacityError",
            "PlanError",
            "VerifyError",
            "RunError",
            "NonFiniteError",
            "UsageError",
        )
    },
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'disco_ray' has no attribute {name!r}")
