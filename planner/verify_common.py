"""What the verifier's checks (planner.verify, planner.verify_order) share: the sink that collects
violations up to a limit, the names they give vertices and ranges, and the sum-into groups found.
"""

from __future__ import annotations

from disco_ray.graph.memgraph import TIERS, Loc, MemVertex, device_name


class Full(Exception):
    """Raised internally once `limit` violations are collected."""


class Sink:
    """The violations found so far; raises Full at the `limit`-th."""

    def __init__(self, limit: int):
        self.limit = limit
        self.msgs: list[str] = []

    def add(self, msg: str) -> None:
        self.msgs.append(msg)
        if len(self.msgs) >= self.limit:
            raise Full


def describe(v: MemVertex) -> str:
    """'vertex 7 (kernel m1 on gpu:0)', 'vertex 9 (sum-into 2/4 of g on gpu:0)'."""
    if v.acc is not None:
        return f"vertex {v.id} (sum-into {v.acc[0]}/{v.acc[1]} of {v.value!r} on gpu:{v.gpu})"
    return f"vertex {v.id} ({v.kind.value} {v.value!r} on gpu:{v.gpu})"


def where(loc: Loc, gpu: int) -> str:
    """'gpu:0[0:16384]', 'host(gpu:1)[0:4096]' or 'disk(gpu:1)[0:4096]'."""
    dev = f"{TIERS[loc.device]}(gpu:{gpu})" if loc.device in TIERS else device_name(loc.device)
    return f"{dev}[{loc.offset}:{loc.end}]"


def arena_key(loc: Loc, gpu: int) -> tuple[int, int]:
    """The arena a location lies in: host stores and spill files are per GPU (HOST and DISK mean
    the vertex's own GPU's)."""
    return (gpu, loc.device) if loc.device in TIERS else (loc.device, 0)


def head(v: MemVertex, n: int) -> str:
    r = v.ins[n]
    return f"{describe(v)} read {n} of {r.value!r} at {where(r.loc, v.gpu)}"


class Groups:
    """The sum-into groups of a MemGraph: per group (an accumulate's id) its members' positions
    (`members`) and its last member's (`rep`, the writer its readers name); `of` maps a member's
    position to its group's index when it writes the group's range (else it is a plain writer)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.members: list[list[int]] = []
        self.rep: list[int] = []
        self.of: dict[int, int] = {}
