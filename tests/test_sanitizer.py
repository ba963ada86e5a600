"""The run-time sanitizer: shadow writers per granule, and whole runs of deliberately broken plans."""

from __future__ import annotations

import pytest

from actors.sanitizer import Sanitizer, granule_for
from disco_ray.driver.api import run_memgraph
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import HOST, Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.graph.reference import random_inputs
from disco_ray.graph.taskgraph import TaskGraph


def san(arena: int = 4096, host: int = 1024, granule: int = 256) -> Sanitizer:
    return Sanitizer(0, arena, host, granule, lambda v: f"vertex {v}")


def test_granule_is_the_gcd_of_ranges_capped_at_256():
    assert granule_for([Loc(0, 0, 1024), Loc(0, 1024, 512)]) == 256
    assert granule_for([Loc(0, 0, 64), Loc(0, 64, 96)]) == 32
    assert granule_for([Loc(0, 3, 5)]) == 1
    assert granule_for([]) == 256


def test_reads_see_their_writer():
    s = san()
    loc = Loc(0, 256, 512)
    s.begin_write(loc, 7)
    s.end_write(loc, 7)
    s.check_read(9, "x", loc, 7, "before it ran")
    with pytest.raises(
        RunError,
        match=r"vertex 9 on gpu:0 reads 'x' at gpu:0 byte 256 .* expected the write "
        r"of vertex 3, found vertex 7",
    ):
        s.check_read(9, "x", loc, 3, "before it ran")


def test_partial_overwrite_unwritten_and_in_flight_writes_are_named():
    s = san()
    s.end_write(Loc(0, 0, 1024), 1)
    s.begin_write(Loc(0, 512, 256), 2)  # vertex 2 is writing the middle right now
    with pytest.raises(RunError, match=r"byte 512 .*found vertex 2 while it was still writing"):
        s.check_read(5, "a", Loc(0, 0, 1024), 1, "after it ran")
    with pytest.raises(RunError, match=r"at host byte 0 .*found nothing \(never written\)"):
        s.check_read(5, "a", Loc(HOST, 0, 256), 4, "before it ran")
    s.reset()
    with pytest.raises(RunError, match="never written"):
        s.check_read(5, "a", Loc(0, 0, 256), 1, "before it ran")


def racy_memgraph(with_mem_edge: bool) -> tuple[TaskGraph, MemGraph]:
    """silu(y) overwrites x's range while silu(x) still needs it; only a memory edge orders them.

    Ids put the overwriter first, so one compute stream (lowest id first, no launch ahead) runs it
    before the reader once both are ready.
    """
    tg = TaskGraph(gpus=1)
    tg.input("x", (8, 8))
    tg.input("y", (8, 8))
    tg.silu("y", id="sy")
    tg.silu("x", id="sx")
    tg.output("sy", "sx")
    r0, r1, r2 = Loc(0, 0, 256), Loc(0, 256, 256), Loc(0, 512, 256)
    verts = [
        MemVertex(0, MKind.INPUT, "x", 0, (), r0),
        MemVertex(1, MKind.INPUT, "y", 0, (), r1),
        MemVertex(2, MKind.KERNEL, "sx", 0, (Read("x", 0, r0),), r2)
        if with_mem_edge
        else MemVertex(2, MKind.KERNEL, "sy", 0, (Read("y", 1, r1),), r0),
        MemVertex(3, MKind.KERNEL, "sy", 0, (Read("y", 1, r1),), r0)
        if with_mem_edge
        else MemVertex(3, MKind.KERNEL, "sx", 0, (Read("x", 0, r0),), r2),
    ]
    if with_mem_edge:  # the correct plan: the reader first, then the overwrite after it
        edges = [(0, 2, "data"), (1, 3, "data"), (2, 3, "mem")]
        outputs = {"sx": 2, "sy": 3}
    else:  # (1, 3) orders nothing that matters: it makes 2 and 3 ready together (inputs run on
        # their own lane, so 3 would otherwise be ready, and run, as soon as x is loaded)
        edges = [(1, 2, "data"), (0, 3, "data"), (1, 3, "mem")]
        outputs = {"sy": 2, "sx": 3}
    return tg, MemGraph([768], verts, edges, outputs, [0])


def test_a_missing_memory_edge_is_caught():
    tg, good = racy_memgraph(True)
    inputs = random_inputs(tg, 0)
    run_memgraph(tg, good, inputs, engine="local", streams=1, check=True)
    tg, bad = racy_memgraph(False)
    with pytest.raises(
        RunError,
        match=r"sanitizer: vertex 3 \(kernel 'sx'\) .* reads 'x' .*expected the write "
        r"of vertex 0 \(input 'x'\), found vertex 2 \(kernel 'sy'\)",
    ):
        run_memgraph(tg, bad, inputs, engine="local", streams=1, ahead=0, check=True, trusted=True)
    # without the sanitizer the run "succeeds" with a wrong result: what the check is for
    out = run_memgraph(tg, bad, inputs, engine="local", streams=1, ahead=0, trusted=True)
    # (trusted: run unverified, as `run --plan --trusted-plan` would; by default verify refuses it)
    assert not out["sx"].allclose(inputs["x"] * inputs["x"].sigmoid())
