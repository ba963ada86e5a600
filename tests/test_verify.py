"""Tests of planner.verify on hand-built MemGraphs: each violation kind is detected and named.

The builders here are shared with test_symbolic.py (no planner involved).
"""

from __future__ import annotations

import dataclasses

import pytest

from disco_ray.graph.errors import VerifyError
from disco_ray.graph.memgraph import HOST, INPUT, Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.graph.taskgraph import TaskGraph
from planner.verify import check, verify
from tests.memgraph_helpers import replaced

S = 1024  # bytes of a float32 [16, 16]


def g0(slot: int, gpu: int = 0) -> Loc:
    return Loc(gpu, slot * S, S)


def offload_graph() -> tuple[TaskGraph, MemGraph]:
    """One GPU with three slots: y is offloaded so z can take its slot, reloaded over x; x is reloaded
    from the caller's copy (src None) over y once y's reader is done."""
    tg = TaskGraph(gpus=1)
    x = tg.input("x", (16, 16), gpu=0)
    y = tg.silu(x, id="y")
    z = tg.scale(x, 2.0, id="z")
    o = tg.mul(y, z, id="o")
    p = tg.add(o, x, id="p")
    tg.output(p)
    host = Loc(HOST, 0, S)
    vs = [
        MemVertex(0, MKind.INPUT, "x", 0, (), g0(0)),
        MemVertex(1, MKind.KERNEL, "y", 0, (Read("x", 0, g0(0)),), g0(1)),
        MemVertex(2, MKind.OFFLOAD, "y", 0, (Read("y", 1, g0(1)),), host),
        MemVertex(3, MKind.KERNEL, "z", 0, (Read("x", 0, g0(0)),), g0(1)),
        MemVertex(4, MKind.RELOAD, "y", 0, (Read("y", 2, host),), g0(0)),
        MemVertex(5, MKind.KERNEL, "o", 0, (Read("y", 4, g0(0)), Read("z", 3, g0(1))), g0(2)),
        MemVertex(6, MKind.RELOAD, "x", 0, (Read("x", None, Loc(INPUT, 0, S)),), g0(0)),
        MemVertex(7, MKind.KERNEL, "p", 0, (Read("o", 5, g0(2)), Read("x", 6, g0(0))), g0(1)),
    ]
    edges = [
        (0, 1, "data"),
        (1, 2, "data"),
        (0, 3, "data"),
        (2, 3, "mem"),
        (2, 4, "data"),
        (3, 4, "mem"),
        (4, 5, "data"),
        (3, 5, "data"),
        (5, 6, "mem"),
        (5, 7, "data"),
        (6, 7, "data"),
    ]
    return tg, MemGraph([3 * S], vs, edges, {"p": 7}, host_capacity=[S])


def transfer_graph() -> tuple[TaskGraph, MemGraph]:
    """Two GPUs: m1 = x0 @ w0 on gpu 0, transferred to gpu 1 (FORMATS.md's example)."""
    tg = TaskGraph(gpus=2)
    x0 = tg.input("x0", (16, 16), gpu=0)
    w0 = tg.input("w0", (16, 16), gpu=0)
    m1 = tg.matmul(x0, w0, id="m1")
    t1 = tg.transfer(m1, gpu=1, id="t1")
    tg.output(t1)
    vs = [
        MemVertex(0, MKind.INPUT, "x0", 0, (), g0(0)),
        MemVertex(1, MKind.INPUT, "w0", 0, (), g0(1)),
        MemVertex(2, MKind.KERNEL, "m1", 0, (Read("x0", 0, g0(0)), Read("w0", 1, g0(1))), g0(2)),
        MemVertex(3, MKind.TRANSFER, "t1", 1, (Read("m1", 2, g0(2)),), g0(0, gpu=1)),
    ]
    edges = [(0, 2, "data"), (1, 2, "data"), (2, 3, "data")]
    return tg, MemGraph([3 * S, S], vs, edges, {"t1": 3})


def replace_vertex(mg: MemGraph, v: MemVertex) -> MemGraph:
    """A copy of `mg` with the vertex of id v.id replaced."""
    return replaced(mg, vertices=[v if u.id == v.id else u for u in mg.vertices])


def without_edge(mg: MemGraph, u: int, w: int) -> MemGraph:
    edges = [e for e in mg.edges if (e[0], e[1]) != (u, w)]
    assert len(edges) == len(mg.edges) - 1
    return replaced(mg, edges=edges)


def one_of(msgs: list[str], *parts: str) -> str:
    """The first message containing every part (fails the test, listing them, if none)."""
    for m in msgs:
        if all(p in m for p in parts):
            return m
    raise AssertionError(f"no violation mentions {parts}; got {msgs}")


@pytest.mark.parametrize("build", [offload_graph, transfer_graph])
def test_correct_memgraphs_pass(build):
    tg, mg = build()
    assert verify(tg, mg) == []
    check(tg, mg)


def test_cycle():
    tg, mg = offload_graph()
    msgs = verify(tg, replaced(mg, edges=[*mg.edges, (7, 1, "mem")]))
    one_of(msgs, "cycle", "7", "1")


def test_gpu_capacity():
    tg, mg = offload_graph()
    one_of(verify(tg, replaced(mg, capacity=[2 * S])), "vertex 5", "gpu:0[2048:3072]", "capacity 2048")


def test_host_capacity():
    tg, mg = offload_graph()
    one_of(verify(tg, replaced(mg, host_capacity=[S // 2])), "vertex 2", "host(gpu:0)[0:1024]", "512")
    assert verify(tg, replaced(mg, host_capacity=[S])) == []  # exactly the host ranges' end fits


@pytest.mark.parametrize("host", [[0], []])
def test_a_host_offload_without_host_capacity_is_refused(host):
    """A declared 0 (or a missing entry, read as 0) allows no host range, as the arena's capacity."""
    tg, mg = offload_graph()
    msgs = verify(tg, replaced(mg, host_capacity=host))
    one_of(msgs, "gpu:0", f"host store use of {S} bytes", "host store capacity 0")
    with pytest.raises(VerifyError, match="host store capacity 0 of gpu:0"):
        check(tg, replaced(mg, host_capacity=host))


def test_operands_out_of_order():
    tg, mg = offload_graph()
    v = mg.vertices[5]
    bad = replace_vertex(mg, dataclasses.replace(v, ins=v.ins[::-1]))
    one_of(verify(tg, bad), "vertex 5", "['z', 'y']", "['y', 'z']")


def test_kernel_realised_twice_and_missing():
    tg, mg = offload_graph()
    extra = MemVertex(8, MKind.KERNEL, "p", 0, mg.vertices[7].ins, g0(1))
    msgs = verify(tg, replaced(mg, vertices=[*mg.vertices, extra], edges=[*mg.edges, (7, 8, "mem")]))
    one_of(msgs, "'p'", "2 MemGraph vertices", "[7, 8]")
    tg2, mg2 = transfer_graph()
    msgs = verify(tg2, replaced(mg2, vertices=mg2.vertices[:3], edges=mg2.edges[:2], outputs={}))
    one_of(msgs, "transfer 't1'", "0 MemGraph vertices")
    one_of(msgs, "output 't1'", "no MemGraph output")


def test_missing_input_vertex():
    tg, mg = transfer_graph()
    v = mg.vertices[1]
    # w0's load replaced by a second load of x0: w0 is used but never loaded
    bad = replace_vertex(mg, dataclasses.replace(v, value="x0"))
    one_of(verify(tg, bad), "input 'w0'", "no input vertex")


def test_wrong_kind_for_value():
    tg, mg = transfer_graph()
    v = mg.vertices[3]
    one_of(
        verify(tg, replace_vertex(mg, dataclasses.replace(v, kind=MKind.KERNEL))),
        "vertex 3",
        "realises TaskGraph transfer 't1'",
    )


def test_read_src_wrote_something_else():
    tg, mg = offload_graph()
    v = mg.vertices[5]
    bad = replace_vertex(mg, dataclasses.replace(v, ins=(Read("y", 1, g0(0)), v.ins[1])))
    one_of(verify(tg, bad), "vertex 5", "read 0 of 'y' at gpu:0[0:1024]", "src vertex 1", "gpu:0[1024:2048]")


def test_read_src_not_an_ancestor():
    tg, mg = offload_graph()
    msgs = verify(tg, without_edge(mg, 4, 5))
    one_of(msgs, "vertex 5", "src vertex 4", "not an ancestor")


def test_src_none_only_for_reload_of_input():
    tg, mg = offload_graph()
    v = mg.vertices[3]
    bad = replace_vertex(mg, dataclasses.replace(v, ins=(Read("x", None, g0(0)),)))
    one_of(verify(tg, bad), "vertex 3", "no src")
    v = mg.vertices[6]
    bad = replace_vertex(mg, dataclasses.replace(v, ins=(Read("x", 0, Loc(INPUT, 0, S)),)))
    one_of(verify(tg, bad), "vertex 6", "names src 0")
    # a reload from the caller's copies must bring back a graph input, not a computed value
    v = mg.vertices[4]
    bad = replace_vertex(mg, dataclasses.replace(v, ins=(Read("y", None, Loc(INPUT, 0, S)),)))
    one_of(verify(tg, bad), "vertex 4", "caller's copy of 'y'", "not a graph input")


def test_race_missing_memory_edge():
    tg, mg = offload_graph()
    # the reload of y over x's slot no longer waits for z, which reads x there
    m = one_of(verify(tg, without_edge(mg, 3, 4)), "race", "vertex 4", "vertex 3", "gpu:0[0:1024]")
    assert "'x'" in m


def test_race_on_host_store():
    tg, mg = offload_graph()
    # an offload of z to the host range y lies in, unordered against the reload of y
    extra = MemVertex(8, MKind.OFFLOAD, "z", 0, (Read("z", 3, g0(1)),), Loc(HOST, 0, S))
    bad = replaced(mg, vertices=[*mg.vertices, extra], edges=[*mg.edges, (3, 8, "data"), (8, 7, "mem")])
    msgs = verify(tg, bad)
    assert len(msgs) == 1
    one_of(msgs, "race", "vertex 8", "host(gpu:0)[0:1024]", "read by vertex 4")
    assert verify(tg, replaced(bad, edges=[*bad.edges, (4, 8, "mem")])) == []


def test_host_stores_are_per_gpu():
    # two GPUs each offload to host offset 0: different stores, so no race
    tg = TaskGraph(gpus=2)
    a = tg.input("a", (16, 16), gpu=0)
    b = tg.input("b", (16, 16), gpu=1)
    tg.output(tg.silu(a, id="sa"), tg.silu(b, id="sb"))
    host = Loc(HOST, 0, S)
    vs = [
        MemVertex(0, MKind.INPUT, "a", 0, (), g0(0)),
        MemVertex(1, MKind.INPUT, "b", 1, (), g0(0, 1)),
        MemVertex(2, MKind.OFFLOAD, "a", 0, (Read("a", 0, g0(0)),), host),
        MemVertex(3, MKind.OFFLOAD, "b", 1, (Read("b", 1, g0(0, 1)),), host),
        MemVertex(4, MKind.KERNEL, "sa", 0, (Read("a", 0, g0(0)),), g0(1)),
        MemVertex(5, MKind.KERNEL, "sb", 1, (Read("b", 1, g0(0, 1)),), g0(1, 1)),
    ]
    edges = [(0, 2, "data"), (1, 3, "data"), (0, 4, "data"), (1, 5, "data")]
    mg = MemGraph([2 * S, 2 * S], vs, edges, {"sa": 4, "sb": 5}, host_capacity=[S, S])
    assert verify(tg, mg) == []
    # a reload on gpu 1 naming gpu 0's offload as src reads the wrong store
    tg.output(tg.transfer("sa", gpu=1, id="t"))
    bad = MemVertex(6, MKind.RELOAD, "a", 1, (Read("a", 2, host),), g0(1, 1))
    mg2 = replaced(mg, vertices=[*vs, bad], edges=[*edges, (2, 6, "data")])
    one_of(verify(tg, mg2), "vertex 6", "src vertex 2")


def test_kernel_output_overlaps_own_input():
    tg, mg = offload_graph()
    v = mg.vertices[7]
    one_of(
        verify(tg, replace_vertex(mg, dataclasses.replace(v, out=g0(2)))),
        "vertex 7",
        "overlaps its own input 'o'",
    )


def test_output_overwritten_later():
    tg, mg = offload_graph()
    tg.output("y")  # y's kernel output at slot 1 is overwritten by z and p
    msgs = verify(tg, replaced(mg, outputs={**mg.outputs, "y": 1}))
    one_of(msgs, "output 'y'", "vertex 3", "not an ancestor of 1")


def test_output_vertex_holds_other_value():
    tg, mg = offload_graph()
    one_of(verify(tg, replaced(mg, outputs={"p": 5})), "output 'p'", "holds 'o'")


def test_partial_overlap_is_a_race():
    tg, mg = offload_graph()
    # z written half a slot lower: still overlaps x at slot 0, which y's kernel reads
    v = mg.vertices[3]
    bad = replace_vertex(mg, dataclasses.replace(v, out=Loc(0, S // 2, S)))
    one_of(verify(tg, bad), "vertex 3", "gpu:0[512:1536]")


def test_kind_rules():
    tg, mg = offload_graph()
    v = mg.vertices[2]
    one_of(
        verify(tg, replace_vertex(mg, dataclasses.replace(v, out=g0(2)))),
        "vertex 2",
        "offload must write the host",
    )
    v = mg.vertices[4]
    one_of(
        verify(tg, replace_vertex(mg, dataclasses.replace(v, ins=(Read("y", 1, g0(1)),)))),
        "vertex 4",
        "reload must read one host, disk or input range",
    )
    tg2, mg2 = transfer_graph()
    v = mg2.vertices[3]
    one_of(
        verify(tg2, replace_vertex(mg2, dataclasses.replace(v, ins=(Read("m1", 2, g0(0, 1)),)))),
        "vertex 3",
        "transfer must read one range of another GPU",
    )


def test_limit_and_check():
    tg, mg = offload_graph()
    bad = replaced(mg, capacity=[S // 4])
    assert len(verify(tg, bad, limit=3)) == 3
    with pytest.raises(VerifyError, match="exceeds gpu:0 capacity 256"):
        check(tg, bad)


def test_json_round_trip_still_verifies():
    tg, mg = offload_graph()
    mg2 = MemGraph.from_dict(mg.to_dict())
    assert verify(tg, mg2) == []
