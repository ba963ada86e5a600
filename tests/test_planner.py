"""Unit tests of BUILDMEMGRAPH on small hand-made graphs (property tests live in test_plan_properties)."""

import pytest

from disco_ray.graph.errors import CapacityError, GraphError
from disco_ray.graph.memgraph import HOST, INPUT, MKind
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph, default_order

T = 64 * 64 * 4  # one float32 64x64 tile: 16 KiB


def chain(n: int, gpus: int = 1) -> TaskGraph:
    """X(i+1) = X(i) @ Y(i), every Y(i) an input: the papers' introduction example on one GPU."""
    g = TaskGraph(gpus=gpus)
    x = g.input("x0", (64, 64))
    for i in range(n):
        x = g.matmul(x, g.input(f"y{i}", (64, 64)), id=f"x{i + 1}")
    g.output(x)
    return g


def kinds(mg):
    return [v.kind for v in mg.vertices]


def test_ample_capacity_needs_no_offload_and_ids_are_topological():
    mg = build_memgraph(chain(6), 100 * T)
    assert MKind.OFFLOAD not in kinds(mg) and MKind.RELOAD not in kinds(mg)
    assert all(u < w for u, w, _ in mg.edges)
    assert [v.id for v in mg.vertices] == list(range(len(mg)))
    assert mg.outputs == {"x6": next(v.id for v in mg.vertices if v.value == "x6")}


def test_every_range_is_aligned_and_inside_capacity():
    cap = 5 * T + 100  # a tail smaller than the alignment is never used
    mg = build_memgraph(chain(8), cap, alignment=256)
    for v in mg.vertices:
        if v.out.device >= 0:
            assert v.out.offset % 256 == 0 and v.out.end <= cap


def test_default_order_puts_each_weight_just_before_its_use():
    assert default_order(chain(3)) == ["x0", "y0", "x1", "y1", "x2", "y2", "x3"]


def test_tight_capacity_reuses_ranges_with_memory_edges():
    mg = build_memgraph(chain(8), 3 * T)
    mem = [e for e in mg.edges if e[2] == "mem"]
    assert mem, "three tiles for 17 values must reuse ranges"
    # an input evicted before its use is never offloaded: inputs reload from their own copy
    for v in mg.vertices:
        if v.kind is MKind.RELOAD and v.value.startswith("y"):
            assert v.ins[0].src is None and v.ins[0].loc.device == INPUT


def test_intermediate_evicted_is_offloaded_then_reloaded():
    g = TaskGraph()
    a = g.input("a", (64, 64))
    b = g.input("b", (64, 64))
    keep = g.matmul(a, b, id="keep")  # used again only at the very end
    x = keep
    for i in range(4):
        x = g.matmul(x, g.input(f"w{i}", (64, 64)), id=f"h{i}")
    g.output(g.add(x, keep, id="out"))
    mg = build_memgraph(g, 3 * T)
    off = [v for v in mg.vertices if v.kind is MKind.OFFLOAD]
    rel = [v for v in mg.vertices if v.kind is MKind.RELOAD and v.value == "keep"]
    assert [v.value for v in off] == ["keep"]
    assert off[0].out.device == HOST and rel and rel[0].ins[0].src == off[0].id
    assert (off[0].id, rel[0].id, "data") in mg.edges
    assert mg.stats["bytes_offloaded"] == T and mg.stats["peak_host_bytes"] == [T]


def test_vertex_that_cannot_fit_is_an_error_naming_it():
    with pytest.raises(CapacityError, match=r"vertex 'x1'.*49152 bytes on gpu 0.*32768"):
        build_memgraph(chain(2), 2 * T)


def test_explicit_order_is_checked():
    g = chain(2)
    with pytest.raises(GraphError, match="comes before its input"):
        build_memgraph(g, 10 * T, order=["x1", "x0", "y0", "y1", "x2"])
    with pytest.raises(GraphError, match="missing"):
        build_memgraph(g, 10 * T, order=["x0", "y0", "x1"])
    mg = build_memgraph(g, 10 * T, order=["x0", "y0", "y1", "x1", "x2"])
    assert mg.stats["order"] == "given"


def test_capacity_per_gpu_and_errors():
    g = TaskGraph(gpus=2)
    x = g.input("x", (64, 64), gpu=0)
    g.output(g.transfer(x, gpu=1, id="t"))
    mg = build_memgraph(g, {0: T, 1: 2 * T})
    assert mg.capacity == [T, 2 * T]
    t = next(v for v in mg.vertices if v.kind is MKind.TRANSFER)
    assert t.gpu == 1 and t.ins[0].loc.device == 0 and t.out.device == 1
    with pytest.raises(GraphError, match="no capacity given for gpu 1"):
        build_memgraph(g, {0: T})
    with pytest.raises(GraphError, match="1 values for 2 GPUs"):
        build_memgraph(g, [T])


def test_outputs_stay_in_place_or_end_on_the_host():
    g = TaskGraph()
    a = g.input("a", (64, 64))
    g.output(g.scale(a, 2.0, id="o"))
    g.silu(a, id="unused")  # never read, not an output; ordered after the output's subtree
    roomy = build_memgraph(g, 3 * T)
    assert roomy.vertex(roomy.outputs["o"]).kind is MKind.KERNEL
    tight = build_memgraph(g, 2 * T)  # 'unused' needs o's room: the finished output is offloaded
    o = tight.vertex(tight.outputs["o"])
    assert o.kind is MKind.OFFLOAD and o.value == "o" and o.out.device == HOST


def test_planning_is_deterministic():
    a = build_memgraph(chain(10), 3 * T).to_dict()
    b = build_memgraph(chain(10), 3 * T).to_dict()
    a["stats"].pop("planning_seconds")
    b["stats"].pop("planning_seconds")
    assert a == b


def _planned_with_pressure():
    from planner import tight_capacity
    from workloads.random_dag import random_dag

    tg = random_dag(400, 3, 5)
    # evictions, reloads, retractions, a bounded host store and the spill file
    mg = build_memgraph(tg, tight_capacity(tg, 0.1), host_capacity=2**14)
    assert mg.stats["evictions"] and mg.stats["bytes_offloaded_disk"]
    return mg


def _planned_again_with_a_group_demoted():
    g = TaskGraph(1)  # (tests/test_sum_into.py: 768 bytes hold no open sum beside a matmul's ranges)
    k0 = g.scale(g.input("k", (4, 4)), 2.0, id="k0")
    parts = [g.matmul(g.input(f"a{i}", (4, 4)), g.input(f"b{i}", (4, 4)), id=f"p{i}") for i in range(6)]
    g.output(g.add(g.kernel("accumulate", *parts, id="acc"), k0, id="out"))
    mg = build_memgraph(g, 768, order=[v.id for v in g])
    assert mg.stats["sum_into_demoted"]["deferred"] == 1  # a first round failed
    return mg


@pytest.mark.parametrize("plan", [_planned_with_pressure, _planned_again_with_a_group_demoted])
def test_planning_leaves_no_reference_cycles(plan):
    """Reference counting frees the whole simulation, that of a failed round included (Planner.close
    breaks the arenas' cycles)."""
    import gc

    plan()  # first-call caches
    gc.collect()
    gc.disable()
    try:
        del plan().vertices
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_the_plan_leaves_the_young_generation_empty():
    """The plan's objects are not left for a young-generation collection to scan (buildmemgraph._settle)."""
    import gc

    gc.collect()
    mg = _planned_with_pressure()
    assert len(mg) > 400
    assert gc.get_count()[0] < 700  # below the default threshold: nothing to scan yet


# ---- the units: the paper's simulation alone, and with sum-into groups --------------------------
def _plan_of(sim):
    """A simulation run in one process, numbered and written as build_memgraph writes it."""
    from planner.export import export
    from planner.number import number

    sim.run()
    part = number(sim, sorted(sim.aux_keys()), {}, [])
    try:
        return export([part], sim.d.ids, sim.d.kept, sim.caps, sim.host_asked, 0.0)
    finally:
        sim.close()


def _same_plan(mg, want):
    assert mg.vertices == want.vertices
    assert list(mg.edges) == list(want.edges)
    assert mg.outputs == want.outputs
    for k in (
        "bytes_offloaded",
        "bytes_reloaded",
        "retractions",
        "compactions",
        "evictions",
        "mem_edges_built",
    ):
        assert mg.stats[k] == want.stats[k], k


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("host", [None, 0])
def test_the_papers_simulation_alone_makes_the_plan_of_a_graph_without_sums(seed, host):
    """planner.simulation needs neither unit: on a graph without accumulates, run alone, it makes
    build_memgraph's plan (evictions, reloads of kept outputs at the end, the disk tier)."""
    from planner import tight_capacity
    from planner.simulation import Simulation
    from workloads.random_dag import random_dag

    tg = random_dag(300, 2, seed, transfer_prob=0.3)
    assert not any(v.op == "accumulate" for v in tg)
    cap = tight_capacity(tg, 0.05)
    want = build_memgraph(tg, cap, workers=1, host_capacity=host)
    assert want.stats["evictions"] > 0, seed
    _same_plan(_plan_of(Simulation(tg, cap, host_capacity=host)), want)


@pytest.mark.parametrize("gpus,cap", [(1, 1536), (2, 1536), (2, 1 << 20)])
def test_the_sum_into_unit_alone_makes_the_plan_of_a_graph_of_sums(gpus, cap):
    from planner.sum_into import SumIntoSimulation
    from tests.test_sum_into import grads

    tg = grads(6, gpus)
    want = build_memgraph(tg, cap, workers=1)
    assert want.stats["sum_into"] == "eager" and "sum_into_demoted" not in want.stats
    mg = _plan_of(SumIntoSimulation(tg, cap))
    assert [v.acc for v in mg.vertices if v.acc] == [v.acc for v in want.vertices if v.acc]
    _same_plan(mg, want)
