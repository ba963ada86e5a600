"""The discrete-event simulator: the papers' worked example exactly, and the scheduling rules."""

from __future__ import annotations

import itertools

import pytest

import workloads
from disco_ray.bench import modes
from disco_ray.bench.profiles import LANES, Profile, UnitCost, a100, h100, lane, p100, unit
from disco_ray.bench.simulate import plot_timeline, simulate
from disco_ray.graph.errors import GraphError
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.taskgraph import TaskGraph
from tests.memgraph_helpers import naive_memgraph


def _example(n: int, gpus: int = 2, hidden: int = 128):
    """DISCO §1: X(i+1) = X(i) x Y(i) on two GPUs, X(1) already there, one unit per matmul/load/transfer."""
    w = workloads.build("matmul_chain", n=n, gpus=gpus, tokens=4, hidden=hidden, materialize=False)
    cost = UnitCost(overrides={f"x0_g{j}": 0.0 for j in range(gpus)})
    return w, cost


def _build_memgraph():
    try:
        from planner import build_memgraph
    except ImportError:
        pytest.skip("planner.build_memgraph is not on this branch yet")
    return build_memgraph


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_worked_example_hand_made(n):
    # memory for one weight block per GPU: loading Y(i+1)_j waits for the matmul that read Y(i)_j
    w, cost = _example(n)
    extra = [(f"p{i}_g{j}", f"y{i + 1}_g{j}") for i in range(n - 1) for j in range(2)]
    mg = naive_memgraph(w.taskgraph, extra)
    assert simulate(mg, w.taskgraph, cost).makespan == 2 * n + 1
    assert simulate(modes.levelwise(mg, w.taskgraph, w.levels), w.taskgraph, cost).makespan == 3 * n


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_worked_example_with_the_planner(n):
    build_memgraph = _build_memgraph()
    w, cost = _example(n)
    tg = w.taskgraph
    block = tg["y0_g0"].nbytes  # 32 KiB; activations are 2 KiB each
    capacity = block + 16 * 1024  # one weight block and room for the activations, not two blocks
    mg = build_memgraph(tg, capacity)
    dyn = simulate(mg, tg, cost)
    lw = simulate(modes.levelwise(mg, tg, w.levels), tg, cost)
    assert (dyn.makespan, lw.makespan) == (2 * n + 1, 3 * n), mg.statistics()
    if n > 1:
        # 2n+1 is the critical path (one load, then a matmul and a gather per level): more room cannot help
        roomy = simulate(build_memgraph(tg, 2 * block + 16 * 1024), tg, cost).makespan
        assert roomy == 2 * n + 1
        # busy: the H2D lane carries n weight loads in 2n+1 units
        assert dyn.busy[0]["h2d"] == pytest.approx(n / (2 * n + 1))


def test_loads_share_a_gpu_lane_but_not_across_gpus():
    g = TaskGraph(2)
    a = g.input("a", (4, 4), gpu=0)
    b = g.input("b", (4, 4), gpu=0)
    c = g.input("c", (4, 4), gpu=1)
    g.output(g.add(a, b), c)
    mg = naive_memgraph(g)
    r = simulate(mg, g, UnitCost())
    spans = {v: (s, e) for v, _, _, s, e in r.timeline}
    assert spans[0] == (0, 1) and spans[1] == (1, 2) and spans[2] == (0, 1)  # a then b on gpu 0; c at once
    assert r.makespan == 2
    assert r.busy[0]["h2d"] == 1.0 and r.busy[1]["h2d"] == 0.5 and r.busy[1]["compute"] == 0


def test_lowest_id_first_and_streams():
    g = TaskGraph(1)
    x = g.input("x", (2, 2))
    outs = [g.matmul(x, x, id=f"m{i}") for i in range(4)]
    g.output(*outs)
    mg = naive_memgraph(g)
    r = simulate(mg, g, UnitCost())
    order = [v for v, _, ln, _, _ in r.timeline if ln == "compute"]
    assert order == [1, 2, 3, 4]
    assert r.makespan == 5  # kernels serialize on the compute lane whatever the streams


def test_one_compute_stream_leaves_copies_on_their_lanes():
    # the runtime's streams: S compute streams, and lanes for copies beside them (actors/lanes.py),
    # so one compute stream serializes the kernels only and the critical path stays 7 units
    w, cost = _example(3)
    extra = [(f"p{i}_g{j}", f"y{i + 1}_g{j}") for i in range(2) for j in range(2)]
    mg = naive_memgraph(w.taskgraph)  # no memory limit: loads could run ahead of the matmuls
    many = simulate(mg, w.taskgraph, cost)
    one = simulate(mg, w.taskgraph, cost, streams=1)
    assert many.makespan == 7  # the critical path: one load, then a matmul and a gather per level
    assert one.makespan == 7
    assert {s for v, s in one.stream_of.items() if mg.vertex(v).kind is MKind.KERNEL} == {0}
    assert {s for v, s in one.stream_of.items() if mg.vertex(v).kind is MKind.INPUT} == {1}  # the h2d lane
    assert simulate(naive_memgraph(w.taskgraph, extra), w.taskgraph, cost, streams=1).makespan == 7


def test_cycle_is_reported():
    g = TaskGraph(1)
    x = g.input("x", (2, 2))
    y = g.matmul(x, x)
    g.output(g.matmul(y, y))
    mg = naive_memgraph(g)
    mg.edges.append((2, 1, "mem"))
    with pytest.raises(GraphError, match="deadlocked"):
        simulate(mg, g, UnitCost())


def test_timeline_respects_edges_and_lanes():
    w = workloads.build("llama_prefill", gpus=2, materialize=False)
    mg = naive_memgraph(w.taskgraph)
    r = simulate(mg, w.taskgraph, h100.with_(streams=3))
    span = {v: (s, e) for v, _, _, s, e in r.timeline}
    for u, v, _ in mg.edges:
        assert span[u][1] <= span[v][0], (u, v)
    by_lane: dict = {}
    for v, g, ln, s, e in r.timeline:
        assert ln == lane(mg.vertex(v)) and g == mg.vertex(v).gpu
        by_lane.setdefault((g, ln), []).append((s, e))
    for spans in by_lane.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    points = sorted({s for _, _, _, s, _ in r.timeline})
    for t in points:  # a GPU profile: one vertex at a time per engine (lane) of a GPU
        for key in by_lane:
            assert sum(1 for _, gg, ln, s, e in r.timeline if (gg, ln) == key and s <= t < e) <= 1
    assert {s for v, s in r.stream_of.items() if mg.vertex(v).kind is MKind.KERNEL} <= {0, 1, 2}
    assert r.makespan == max(e for *_, e in r.timeline)
    assert all(0 <= f <= 1 for b in r.busy for f in b.values())
    assert set(r.busy[0]) == set(LANES)


def test_profile_rates():
    g = TaskGraph(1)
    a = g.input("a", (8192, 8192), "float16")
    g.output(g.matmul(a, a))
    mg = naive_memgraph(g)
    r = simulate(mg, g, h100)
    load, mm = (e - s for _, _, _, s, e in r.timeline)
    assert load == pytest.approx(2.52e-3, rel=0.01)  # GPU.md: H2D of a 128 MiB tile, 2.5 ms
    assert mm == pytest.approx(1.45e-3, rel=0.01)  # GPU.md: fp16 8192^3 matmul, 1.45 ms
    # a small elementwise kernel is bound by memory traffic, plus the launch cost
    g2 = TaskGraph(1)
    x = g2.input("x", (1024, 1024))
    g2.output(g2.add(x, x))
    t = simulate(naive_memgraph(g2), g2, h100.with_(launch=0)).timeline[1]
    assert t[4] - t[3] == pytest.approx(3 * 4 * 2**20 / h100.hbm)
    assert p100.flops["float16"] < a100.flops["float16"] < h100.flops["float16"]
    # a slow kernel (op_speed) takes proportionally longer, on compute and memory alike
    half = h100.with_(launch=0, op_speed={"add": 0.5})
    t2 = simulate(naive_memgraph(g2), g2, half).timeline[1]
    assert t2[4] - t2[3] == pytest.approx(2 * (t[4] - t[3]))
    assert isinstance(h100.with_(streams=2), Profile) and h100.with_(streams=2).streams == 2
    assert unit.time(mg.vertices[1], g[mg.vertices[1].value], [(8192, 8192)] * 2) == 1.0


def test_unit_cost_kinds():
    g = TaskGraph(2)
    a = g.input("a", (2, 2), gpu=0)
    s = g.kernel("softmax", a)
    g.output(g.transfer(s, 1))
    mg = naive_memgraph(g)
    kinds = [v.kind for v in mg.vertices]
    assert kinds == [MKind.INPUT, MKind.KERNEL, MKind.TRANSFER]
    r = simulate(mg, g, UnitCost(load=2, transfer=3))
    assert r.makespan == 5  # load 2, softmax free, transfer 3
    assert simulate(mg, g, UnitCost(kernel={"softmax": 4}, launch=0.5)).makespan == 1.5 + 4.5 + 1.5


def test_plot_timeline(tmp_path):
    w, cost = _example(2)
    r = simulate(naive_memgraph(w.taskgraph), w.taskgraph, cost)
    path = tmp_path / "t.png"
    plot_timeline(r, str(path), labels={0: "x"})
    assert path.stat().st_size > 1000
