"""The planner: TaskGraph -> MemGraph (BUILDMEMGRAPH), the arena allocator and the verifier. No Ray."""

from .buildmemgraph import build_memgraph
from .order import check_order, default_order

__all__ = ["build_memgraph", "check_order", "default_order"]
