"""The data model every other package imports: TaskGraph, MemGraph, the op set and its torch
kernels, tensor dtypes and byte sizes, the file formats, the plain-torch reference and the error
hierarchy. Nothing here imports the planner, the actors, the workloads or the driver.
"""

from .errors import (
    CapacityError,
    DiscoError,
    FormatError,
    FrontendError,
    GraphError,
    PlanError,
    RunError,
    UsageError,
    VerifyError,
)
from .memgraph import MemGraph, MKind
from .taskgraph import Kind, TaskGraph

__all__ = [
    "CapacityError",
    "DiscoError",
    "FormatError",
    "FrontendError",
    "GraphError",
    "Kind",
    "MKind",
    "MemGraph",
    "PlanError",
    "RunError",
    "TaskGraph",
    "UsageError",
    "VerifyError",
]
