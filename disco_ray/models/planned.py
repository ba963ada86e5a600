"""A model's plans: the graph of each plan key planned at the current capacity on first use and
kept per capacity, its Program loaded into the pool's workers, and the micro-batches of a batch
step chosen by the plans (`choose_micro`)."""

from __future__ import annotations

import time

from disco_ray.driver.program import Program
from disco_ray.graph.errors import CapacityError, UsageError
from disco_ray.graph.memgraph import MemGraph
from planner import build_memgraph, min_capacity
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.model import ModelGraph

from .graphs import bytes_moved, model_graph
from .programs import Programs, plan_entry


class PlannedModel(Programs):
    """The plans of a model on a pool of workers; `LlamaModel` sets the state below."""

    ck: Checkpoint
    gpus: int
    block: int
    dtype: str
    tile: int
    planning_s: float
    load_s: float
    clamped: int  # plans made at a vertex's minimum because the capacity was below it
    resizes: list[dict]
    micro_choices: list[dict]
    _plans: dict[tuple, tuple[ModelGraph, MemGraph]]
    _micros: dict[tuple, int]

    def _caps(self) -> list[int]:
        c = self.capacity
        return [int(c)] * self.gpus if isinstance(c, int) else [int(x) for x in c]

    def _program(self, key: tuple) -> tuple[ModelGraph, Program]:
        """The graph and Program of `key` at the current capacity: planned on first use (plans
        are kept per capacity, so going back to a capacity plans nothing)."""
        got = self._programs.get(key)
        if got is not None:
            return got
        mgraph, mg = self._plan(key)
        prog = Program(mgraph.taskgraph, mg, **self._prog_kw)
        t = time.perf_counter()
        prog.engine  # noqa: B018  (loads the graph into the workers now, not in the first run)
        self.load_s += time.perf_counter() - t
        got = self._programs[key] = (mgraph, prog)
        return got

    def _plan(self, key: tuple) -> tuple[ModelGraph, MemGraph]:
        """The graph of `key` and its plan at the current capacity, planned on first use."""
        caps = self._caps()
        planned = self._plans.get((key, tuple(caps)))
        if planned is None:
            t = time.perf_counter()
            mgraph = model_graph(self.ck, self.gpus, key, self.block, self.dtype, self.tile)
            tg = mgraph.taskgraph
            need = min_capacity(tg)
            if self.resizes and any(c < n for c, n in zip(caps, need)):
                # an elastic budget below what one vertex needs: run at that minimum, not fail
                # (a capacity given at the start that small is an error, the planner's)
                self.clamped += 1
                caps = [max(c, n) for c, n in zip(caps, need)]
            # the builder's order: layer by layer, each tile's vertices together
            order = mgraph.order or list(tg.vertices)  # a batch's micro-batches: zig-zag
            mg = build_memgraph(tg, caps, order=order, host_capacity=self.host_capacity)
            dt = time.perf_counter() - t
            self.planning_s += dt
            self.plans.append(plan_entry("/".join(str(k) for k in key), tg, mg, dt, capacity=caps))
            planned = self._plans[(key, tuple(self._caps()))] = (mgraph, mg)
        return planned

    def choose_micro(self, kind: str, rows: int, blocks: int, extra: tuple = ()) -> int:
        """The micro-batches of a batch step (`kind` "batch_prefill" or "batch_decode", `rows`
        rows, `blocks` cache blocks) at the current capacity, chosen by the plans: each power of
        two up to `rows` is planned and the one whose plan moves the fewest bytes between host
        and device wins (ties: fewer micro-batches). Made once per (step, capacity), so a resize
        chooses again at the next step, and going back to a capacity chooses nothing. `extra`: the
        rest of the plan key (a sampling decode step's stop ids per row)."""
        caps = tuple(self._caps())
        got = self._micros.get((kind, rows, blocks, caps, *extra))
        if got is not None:
            return got
        moved: dict[int, int | str] = {}
        m = 1
        while m <= rows:
            try:
                moved[m] = bytes_moved(self._plan((kind, rows, blocks, m, *extra))[1])
            except (CapacityError, UsageError) as e:  # this split does not plan: the others may
                moved[m] = str(e)
            m *= 2
        fits = [m for m, b in moved.items() if isinstance(b, int)]
        if not fits:
            raise CapacityError(f"{kind} of {rows} rows plans with no micro-batch count: {moved[1]}")
        best = min(fits, key=lambda m: (moved[m], m))
        self._micros[(kind, rows, blocks, caps, *extra)] = best
        self.micro_choices.append(
            {
                "kind": kind,
                "rows": rows,
                "blocks": blocks,
                "capacity": list(caps),
                "micro": best,
                "moved": moved,
            }
        )
        return best
