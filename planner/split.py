"""Planning the GPUs in parallel processes: a plan split into parts, one per group of GPUs.

BUILDMEMGRAPH's simulation couples the GPUs only through transfers: every other vertex reads and
writes the arena of its own GPU, and the serial order V fixes when each value is read, so each
GPU's allocations, evictions and memory edges depend on V alone. A part simulates all of V on its
GPUs only. A transfer between two parts is done in both: the part of the source GPU makes the read
(reloading the operand if it is out, noting where it lay and who wrote it: `xreads`), the part of
the destination makes the vertex (its range and memory edges: `pending`), and `planner.export.merge`
joins the two. A record of one part that another part names (the transfer, as a reader of its operand; the
operand's writer) is a *phantom* there: a record with no location, renamed by its sort key when
the parts' records are numbered together (keys of V[t] itself are the same in every part; parts
number their offload and reload keys apart: Planner.run).

The plan equals the one-process plan up to the order of offloads and reloads that two parts make
at the same step (tests/test_split.py), so every guarantee carries over. The differences: a
sum-into group's range in the way (GroupError) names the open groups of that part only, and the
id windows of implied-edge pruning shift with the order.

Processes are forked (the plan's inputs are shared, not sent); the parts' records come back
pickled. A part that fails sends its error; one that dies stops the plan with an error naming it.
Forking is only done by default when this process runs no other thread (a fork copies only the
calling thread, so a lock another thread holds would stay locked in the child) and V is long
enough to gain; `build_memgraph(workers=...)` forces it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Sequence
from typing import Protocol

from disco_ray.graph.errors import GraphError, PlanError

from .records import Part

MIN_STEPS = 50_000  # V shorter than this is planned in one process (forking and merging cost more)


class Planner(Protocol):
    """What a part needs of planner.buildmemgraph.Planner (which imports this module)."""

    def run(self, gpus: Sequence[int] | None = None, tag: int = 0, parts: int = 1) -> None: ...
    def aux_keys(self) -> list[int]: ...
    def part(self, aux: Sequence[int], portable: bool = False) -> Part: ...
    def close(self) -> None: ...


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def fork_safe() -> bool:
    """Whether no other thread runs here (a fork copies only the calling thread: a lock another
    thread held would stay locked in the child)."""
    return threading.active_count() == 1


def groups(gpu: Sequence[int], gpus: int, workers: int | None, steps: int) -> list[list[int]] | None:
    """The GPUs of each part, balanced by vertex count (None: plan in one process).

    Args:
        gpu: the GPU of every TaskGraph vertex.
        gpus: how many GPUs.
        workers: processes to use; None: as many as usable CPUs, when V has `MIN_STEPS` steps or
            more and forking is safe here (no other thread runs).
        steps: the length of V.
    """
    if workers is None:
        if steps < MIN_STEPS or not fork_safe():
            return None
        workers = usable_cpus()
    elif workers < 1:
        raise GraphError(f"workers must be 1 or more, got {workers}")
    workers = min(workers, gpus)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return None
    load = [0] * gpus
    for g in gpu:
        load[g] += 1
    out: list[list[int]] = [[] for _ in range(workers)]
    total = [0] * workers
    for g in sorted(range(gpus), key=lambda g: -load[g]):  # the largest first, to the lightest part
        i = total.index(min(total))
        out[i].append(g)
        total[i] += load[g]
    return [sorted(gs) for gs in out if gs]


def run_split(p: Planner, parts: list[list[int]]) -> list[Part]:
    """Simulates part 0 here and the others in forked processes; returns every part numbered.

    The parts swap the keys of their offloads and reloads (few) so that each numbers its own
    vertices (Planner.part) at once: this process its own while the others do theirs and send
    them.
    """
    ctx = multiprocessing.get_context("fork")
    children = []
    try:
        for tag, gpus in enumerate(parts[1:], 1):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_simulate,
                args=(p, gpus, tag, len(parts), there),
                name=f"planner-gpus-{gpus}",
                daemon=True,
            )
            proc.start()
            there.close()
            children.append((proc, here, gpus))
        p.run(parts[0], 0, len(parts))
        aux = p.aux_keys()
        for child in children:
            aux += _receive(*child)
        aux.sort()
        for _, conn, _ in children:
            conn.send(aux)
        out = [p.part(aux)]
        p.close()  # while the other parts send theirs
        for child in children:
            out.append(_receive(*child))
        return out
    finally:
        for proc, conn, _ in children:
            conn.close()
            if proc.is_alive():
                proc.kill()
            proc.join()


def _receive(proc, conn, gpus: list[int]):
    try:
        got = conn.recv()
    except EOFError:
        proc.join()
        raise PlanError(f"the planner process for gpus {gpus} died (exit code {proc.exitcode})") from None
    if isinstance(got, BaseException):
        raise got
    return got


def _simulate(p: Planner, gpus: list[int], tag: int, parts: int, conn) -> None:
    """A forked part: simulates its GPUs, swaps offload and reload keys, sends its vertices (or its
    error) back."""
    try:
        p.run(gpus, tag, parts)
        conn.send(p.aux_keys())
        msg: object = p.part(conn.recv(), portable=True)
    except BaseException as e:  # sent to the parent, which raises it
        msg = e.with_traceback(None)
    conn.send(msg)
    conn.close()
