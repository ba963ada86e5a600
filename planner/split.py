"""Split parts: what planning the GPUs in parallel processes adds to BUILDMEMGRAPH.

The paper simulates V on every GPU at once. Its simulation couples the GPUs only through
transfers: every other vertex reads and writes the arena of its own GPU, and the serial order V
fixes when each value is read, so each GPU's allocations, evictions and memory edges depend on V
alone. A part (`PartSimulation`) simulates all of V on its GPUs only, one forked process per group
of GPUs (`workers`): the steps of other GPUs are skipped (Step.SKIP). A transfer between two parts
is done in both: the part of the source GPU makes the read (Step.SOURCE: reloading the operand if
it is out, noting where it lay and who wrote it: `xreads`), the part of the destination makes the
vertex (Step.DEST: its range and memory edges: `pending`), and `planner.export.merge` joins the
two. A record of one part that another part names (the transfer, as a reader of its operand; the
operand's writer) is a *phantom* there: a record with no location, renamed by its sort key when
the parts' records are numbered together (keys of V[t] itself are the same in every part; parts
number their offload and reload keys apart, `run`). Each part numbers its own vertices
(planner.number) once the parts have swapped the keys of their offloads and reloads.

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
from collections.abc import Callable, Sequence
from typing import Any, cast

from disco_ray.graph.errors import GraphError, PlanError
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.taskgraph import Kind

from .number import Xread, number
from .records import STEP, Inst, Part
from .simulation import Step
from .state import INF, OWN_BIT
from .sum_into import SumIntoSimulation

MIN_STEPS = 50_000  # V shorter than this is planned in one process (forking and merging cost more)


class PartSimulation(SumIntoSimulation):
    """The simulation of V on some GPUs only, as one part of a split plan (`run(gpus, ...)`), or
    on all of them."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.own: list[bool] | None = None  # per GPU: simulated here (None: all are)
        self.pending: dict[int, int] = {}  # transfer -> its record, whose read another part makes
        self.xreads: list[Xread] = []  # reads made here of transfers to other parts' GPUs

    def run(self, gpus: Sequence[int] | None = None, tag: int = 0, parts: int = 1) -> None:
        """Simulates V: on every GPU, or as part `tag` of `parts` on `gpus` only."""
        if gpus is not None and len(gpus) < self.d.gpus:
            self.gpus = sorted(gpus)
            self.own = [g in self.gpus for g in range(self.d.gpus)]
            self.aux, self.stride = tag, parts  # aux keys unique across the parts
            self.wake.intersection_update(gpus)
        super().run()

    def part(self, aux: Sequence[int], portable: bool = False) -> Part:
        """This simulation's vertices numbered, given the sorted keys of every part's offloads and
        reloads (planner.number)."""
        return number(self, aux, self.pending, self.xreads, portable)

    def codes(self) -> bytes:
        """Per step of V, what this part does: the step's own code on its GPUs, SKIP on the
        others', SOURCE (the read of a transfer to another part's GPU) or DEST (a transfer from
        another part's GPU)."""
        codes = super().codes()
        own = self.own
        if own is None:
            return codes
        d, n = self.d, len(self.d)
        gpu, kind, operands, acc = d.gpu, d.kind, d.operands, self.mem.acc if self.mem is not None else ()
        out = bytearray(codes)
        for t, k in enumerate(self.seq):
            if k >= n:
                k = acc[k - n]
            if kind[k] is Kind.TRANSFER:
                src, dst = own[gpu[operands[k][0]]], own[gpu[k]]
                if not dst:
                    out[t] = Step.SOURCE if src else Step.SKIP
                elif not src:
                    out[t] = Step.DEST
            elif not own[gpu[k]]:
                out[t] = Step.SKIP
        return bytes(out)

    def _handlers(self) -> dict[int, Callable[[int], None]]:
        return {**super()._handlers(), Step.SOURCE: self._execute_source, Step.DEST: self._execute_dest}

    def _execute_source(self, t: int, compacted: bool = False) -> None:
        """The read half of transfer V[t] to another part's GPU: reloads its operand if need be, and
        notes the read (the part of the destination makes the vertex)."""
        d = self.d
        k = self.seq[t]
        (x,) = d.operands[k]
        r = self.rec_of[k]
        if r < 0:  # the transfer as a reader here: a phantom (no location), numbered by its key
            r = self.rec_of[k] = self._new(MKind.TRANSFER, k, d.gpu[k], (t << STEP) | OWN_BIT)
        res = self.resident
        if res[x] is None and not self._bring(k, x, compacted):
            return self._execute_source(t, compacted=True)
        inst = cast(Inst, res[x])
        self.xreads.append((k, x, inst.src, None if inst.writers is None else tuple(inst.writers), inst.loc))
        inst.readers.append(r)
        self._read(x, inst)

    def _execute_dest(self, t: int) -> None:
        """The write half of transfer V[t] from another part's GPU: its operand's read comes in
        when the parts are merged."""
        k = self.seq[t]
        if not self.allocated[k]:
            self._room_for_output(k)
        own = cast(Inst, self.resident[k])
        own.produced = True
        uk = self.uses[k]
        own.dist = uk[0] if uk else INF
        self.pending[k] = self.rec_of[k]
        if not uk and k not in self.kept:
            self._free(k)


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


def run_split(p: PartSimulation, parts: list[list[int]]) -> list[Part]:
    """Simulates part 0 here and the others in forked processes; returns every part numbered.

    The parts swap the keys of their offloads and reloads (few) so that each numbers its own
    vertices (planner.number) at once: this process its own while the others do theirs and send
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


def _simulate(p: PartSimulation, gpus: list[int], tag: int, parts: int, conn) -> None:
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
