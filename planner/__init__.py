"""The planner: TaskGraph -> MemGraph (BUILDMEMGRAPH), the arena allocator and the verifier. No Ray."""

from .buildmemgraph import build_memgraph
from .capacity import CapacityBounds, min_capacity, roomy_capacity, tight_capacity
from .order import check_order, default_order

__all__ = [
    "CapacityBounds",
    "build_memgraph",
    "check_order",
    "default_order",
    "min_capacity",
    "roomy_capacity",
    "tight_capacity",
]
