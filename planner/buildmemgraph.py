"""BUILDMEMGRAPH (TURNIP section 6): TaskGraph -> MemGraph, the units put together.

- planner.simulation: the paper's simulated execution of the serial order V (planner.order), with
  the two horizons, victims by next use, retraction, compaction and the memory tiers;
- planner.sum_into: an `accumulate` as sum-into members (TURNIP appendix A), a range held in place
  between them; a plan in which an open sum blocks a vertex raises GroupError, and is made again
  here with those groups demoted;
- planner.split: the GPUs simulated in parts, one forked process each, joined by planner.export;
- planner.number numbers each simulation's records, planner.export writes the MemGraph (memory
  edges implied by other paths dropped, planner.prune).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping, Sequence

from disco_ray.graph.errors import CapacityError, DiscoError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .capacity import log_rounding
from .conditions import condition
from .export import export
from .groups import MODES
from .prune import WINDOW
from .records import Part
from .split import PartSimulation, groups, run_split
from .state import FIT
from .sum_into import SUM_INTO, GroupError, demote

__all__ = ["FIT", "SUM_INTO", "GroupError", "Planner", "build_memgraph"]

Planner = PartSimulation  # the whole simulation: the paper's, with sum-into groups and split parts
log = logging.getLogger("disco_ray.planner")  # under "disco_ray": the CLI's -v and -q reach it
ROUNDS = 4  # plans made again with the blocking groups demoted before a mode is given up for all


def build_memgraph(
    tg: TaskGraph,
    capacity: int | Sequence[int] | Mapping[int, int],
    *,
    order: Sequence[str] | None = None,
    alignment: int = 256,
    lookahead: int | None = None,
    fit: str = FIT,
    window: int = WINDOW,
    sum_into: str = SUM_INTO,
    host_capacity: int | Sequence[int | None] | Mapping[int, int | None] | None = None,
    workers: int | None = None,
) -> MemGraph:
    """Compiles a TaskGraph into a MemGraph for GPUs of the given arena capacities.

    Args:
        tg: the TaskGraph.
        capacity: arena bytes, one int for every GPU or a list/dict per GPU.
        order: the serial order V (a topological order of all vertex ids); default: the schedule
            order (`planner.order.default_order` for these capacities).
        alignment: every range starts and is sized at a multiple of this many bytes.
        lookahead: how many vertices the allocation horizon may run ahead (None: unbounded).
        fit: the free-range choice, "oldest" (last use furthest in the past) or "best" (tightest).
        window: ids within which implied memory edges are found and dropped (0: keep them all).
        sum_into: how an `accumulate` is planned: "eager" (a sum-into kernel per operand right after
            it, planner.groups), "deferred" (all of them at the accumulate's place) or "off" (one
            kernel reading every operand). A plan in which open sums' ranges block a vertex is
            made again with those groups demoted (eager -> deferred -> one kernel), up to ROUNDS
            times, then with every group in the next mode.
        host_capacity: host-store bytes per GPU (one int, a list or dict per GPU; None or an entry
            None: unbounded). An offload that does not fit goes to the GPU's spill file (disk).
        workers: processes that simulate the GPUs in parallel (planner.split); None: every usable
            CPU when the graph is large and this process runs no other thread, else 1.

    Raises:
        CapacityError: a vertex's inputs plus output do not fit its GPU.
        GraphError: a bad order or capacity.
    """
    started = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # the simulation makes millions of small acyclic objects: cyclic GC passes only cost
    p = None
    log.debug("plan: %d vertices on %d GPU(s), fit %s, sum-into %s", len(tg), tg.gpus, fit, sum_into)
    try:
        p, parts = _plan_with_groups(
            tg, capacity, order, alignment, lookahead, fit, sum_into, host_capacity, workers
        )
        log.debug(
            "plan: simulated in %.3f s (%d planner process(es)); exporting the MemGraph",
            time.perf_counter() - started,
            len(parts),
        )
        mg = export(parts, p.d.ids, p.d.kept, p.caps, p.host_asked, started, window)
        log_rounding(p.asked, p.caps, alignment)
    finally:
        if p is not None:
            p.close()
        if collecting:
            _settle()
            gc.enable()
    mg.stats["order"] = p.order_name if order is not None else f"default ({p.order_name})"
    mg.stats["fit"] = fit
    mg.stats["sum_into"] = p.sum_into
    mg.stats["planner_processes"] = len(parts)
    if p.demoted:
        mg.stats["sum_into_demoted"] = {
            m: sum(1 for x in p.demoted.values() if x == m) for m in ("deferred", "off")
        }
    if tg.conditional:  # the vertices a run may skip, after their flags (planner.conditions)
        mg = condition(mg, tg)
    mg._planned_for = id(tg)  # this process's own plan of tg: Program runs it unverified
    log.debug("plan: %d MemGraph vertices in %.3f s", len(mg), time.perf_counter() - started)
    return mg


def _settle() -> None:
    """Moves the objects made while the collector was off into its oldest generation, unscanned.

    The plan's millions of objects are long-lived and acyclic, and the planner's own cycles are
    broken (State.close), so the young-generation pass that re-enabling the collector would
    start finds nothing; on the 65B prefill plan it took 1.9 s of a 12 s call. freeze() and
    unfreeze() move the generations' lists in O(1); skipped where the caller froze objects itself
    (unfreeze would release theirs).
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def _plan_with_groups(
    tg, capacity, order, alignment, lookahead, fit, sum_into: str, host_capacity, workers
) -> tuple[Planner, list[Part]]:
    """Runs the Planner, demoting the sum-into groups in the way after each GroupError."""
    modes = MODES[MODES.index(sum_into) :]
    demoted: dict[int, str] = {}
    mi = rounds = 0
    while True:
        mode = modes[mi]
        try:
            p = Planner(
                tg,
                capacity,
                order,
                alignment,
                lookahead,
                fit,
                sum_into=mode,
                demoted=demoted,
                host_capacity=host_capacity,
            )
            try:
                parts = groups(p.d.gpu, tg.gpus, workers, len(p.seq))
                if parts is None:
                    p.run()
                    return p, [p.part(sorted(p.aux_keys()))]
                return p, run_split(p, parts)
            except BaseException:
                p.close()  # a failed round's simulation is freed by reference counting too
                raise
        except CapacityError:
            if "off" not in demoted.values():
                raise  # not for want of a demoted group's room: no mode helps
            e: DiscoError = CapacityError("a demoted accumulate does not fit as one kernel")
            rounds = ROUNDS
        except GroupError as ge:
            e = ge.with_traceback(None)  # kept for the end: its frames would hold the failed round
            demote(demoted, ge.groups, mode)
        rounds += 1
        if rounds > ROUNDS:
            mi, rounds, demoted = mi + 1, 0, {}
            if mi == len(modes):
                raise e
        log.info("sum-into %s: %s; planning again", mode, e)
