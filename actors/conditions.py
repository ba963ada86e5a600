"""Conditional vertices at run time (docs/FORMATS.md, "Conditional vertices"): one worker's
decisions of which of its vertices a run skips, and the bytes its expert loads moved.

A vertex marked `when` in the MemGraph (planner.conditions) runs only if one of its flags (a
column of a flag writer's [rows, n] output) has a non-zero row in this run. The worker reads a
flag writer's output right after its kernel (`flagged`: on a GPU, a small device-to-host read);
the plan orders every conditional vertex after its flag writers, so its decision (`skips`) is
made when the vertex runs, and a skipped vertex completes at once on its stream: no bytes moved,
no kernel run. A flag not read yet (a kernel launched ahead on an asynchronous backend) counts
as set: the vertex runs, which is always correct. A skipped load leaves no value in its range,
so the next run loads it again (`forget`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from disco_ray.graph.memgraph import MemGraph, MKind

from .plans import PlanKind, VertexPlan

LOADS = (PlanKind.INPUT, PlanKind.RELOAD_INPUT, PlanKind.UNSPILL)  # into the arena from host or disk


class Conditions:
    """The conditional vertices of GPU `gpu` of `mg` (`plans`: the worker's) and this run's flags."""

    def __init__(self, mg: MemGraph, gpu: int, plans: Mapping[int, VertexPlan]):
        self.when = {v.id: v.when for v in mg.vertices if v.gpu == gpu and v.when}
        self.writers = frozenset(u for w in self.when.values() for u, _ in w)
        self.loads = {
            vid: plans[vid].out_loc.nbytes
            for vid in self.when
            if plans[vid].kind in LOADS
            or (plans[vid].kind is PlanKind.COPY and mg.vertex(vid).kind is MKind.RELOAD)
        }
        self.input_ranges = {
            vid: (plans[vid].out_loc.offset, plans[vid].out_loc.nbytes)
            for vid in self.when
            if plans[vid].kind is PlanKind.INPUT
        }
        self.begin()

    def begin(self) -> None:
        """A new run: no flag read, nothing skipped."""
        self.flags: dict[int, list[bool]] = {}
        self.skipped: list[int] = []  # list.append is atomic: the stream threads share it

    def flagged(self, vid: int, out: torch.Tensor) -> None:
        """Flag writer `vid` ran: per column of its output, whether some row is non-zero."""
        self.flags[vid] = (out != 0).any(dim=0).tolist()

    def flagged_for(self, vid: int) -> bool:
        """Whether some flag of conditional vertex `vid` is set or not read yet (it must run)."""
        for u, n in self.when[vid]:
            f = self.flags.get(u)
            if f is None or f[n]:
                return True
        return False

    def skips(self, vid: int) -> bool:
        """Whether conditional vertex `vid` is skipped in this run (recorded when it is)."""
        if self.flagged_for(vid):
            return False
        self.skipped.append(vid)
        return True

    def forget(self, tokens: dict, held: frozenset[int]) -> None:
        """The ranges of this run's skipped input loads hold no value (`Loads.tokens`); a load
        skipped because the range held its value already (`held`) still holds it."""
        for vid in self.skipped:
            where = self.input_ranges.get(vid)
            if where is not None and vid not in held:
                tokens.pop(where, None)

    def statistics(self, held: frozenset[int]) -> dict:
        """This run's conditional vertices: skipped, and the bytes of their loads moved, skipped
        (not flagged) and not needed (flagged, and the arena held the value from an earlier run)."""
        skipped = set(self.skipped) | {v for v in self.loads if v in held and not self.flagged_for(v)}
        kept = {v for v in self.loads if v in held and v not in skipped}
        return {
            "vertices": len(self.when),
            "skipped": len(skipped),
            "load_bytes": sum(b for v, b in self.loads.items() if v not in skipped and v not in kept),
            "skipped_bytes": sum(b for v, b in self.loads.items() if v in skipped),
            "held_bytes": sum(self.loads[v] for v in kept),
        }
